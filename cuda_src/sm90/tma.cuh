// Tensor Memory Accelerator (sm_90): bulk tensor copies between global and shared memory,
// described by a tensor map that the host encodes (cuflash/_core/tma.py, cuTensorMapEncodeTiled).
//
// Coordinates are element indices, innermost dimension first (the tensor map's order, the
// reverse of a NumPy shape). A load copies one box of the map into shared memory, swizzled as
// the map says, and completes its bytes on an mbarrier (sm90/mbarrier.cuh); boxes that reach
// past the tensor are filled with zeros and still deliver every byte of the box.
#pragma once
#include "common/smem.cuh"
#include "common/types.cuh"
#include "sm90/mbarrier.cuh"

namespace cuflash {
namespace sm90 {

// CUtensorMap without the CUDA headers (NVRTC compiles cuflash with no CUDA include path): 128
// opaque bytes, 64-byte aligned, as cuda.h declares it. Kernels take it by value inside a
// __grid_constant__ parameter struct, so its address is a generic address into the parameter
// space, which is where the TMA unit may read it from.
struct alignas(64) TensorMap {
  u64 opaque[16];
};
static_assert(sizeof(TensorMap) == 128 && alignof(TensorMap) == 64, "CUtensorMap is 128 bytes, 64-aligned");

// Brings a tensor map into the TMA unit's descriptor cache ahead of its first copy; the first
// copy otherwise waits for that fetch. Any one thread, once per map, early in the kernel.
__device__ __forceinline__ void prefetch_tensor_map(const TensorMap* map) {
  asm volatile("prefetch.tensormap [%0];" ::"l"(map) : "memory");
}

// Loads: one box at coordinates (c0 innermost, ...) into `dst` (shared memory; 1024-byte aligned
// for the 128-byte swizzle, so the swizzle pattern lines up with the one wgmma assumes), with its
// bytes completing on `bar`. The destination is named in the shared::cluster window; a CTA's own
// shared::cta address is a valid shared::cluster address of that CTA. One thread issues it; the
// same thread (or another) must have announced the bytes with mbarrier_arrive_expect_tx.
__device__ __forceinline__ void tma_load(void* dst, const TensorMap* map, u64* bar, int c0, int c1) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%3, %4}], [%2];" ::"r"(smem_addr(dst)),
      "l"(map), "r"(smem_addr(bar)), "r"(c0), "r"(c1)
      : "memory");
}
__device__ __forceinline__ void tma_load(void* dst, const TensorMap* map, u64* bar, int c0, int c1, int c2) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%3, %4, %5}], [%2];" ::"r"(smem_addr(dst)),
      "l"(map), "r"(smem_addr(bar)), "r"(c0), "r"(c1), "r"(c2)
      : "memory");
}
__device__ __forceinline__ void tma_load(void* dst, const TensorMap* map, u64* bar, int c0, int c1, int c2,
                                         int c3) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%3, %4, %5, %6}], [%2];" ::"r"(smem_addr(dst)),
      "l"(map), "r"(smem_addr(bar)), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
      : "memory");
}
// A tile of PANELS boxes of a 4-D map over a BSHD tensor (sm90 params: head_dim, heads, rows,
// batch): box p holds columns 64 p .. 64 p + 63 of head c1, rows from c2, batch c3, at
// dst + p * panel_bytes; every box completes on `bar`.
template <int PANELS>
__device__ __forceinline__ void tma_load_panels(unsigned char* dst, u32 panel_bytes, const TensorMap* map, u64* bar,
                                                int c1, int c2, int c3) {
#pragma unroll
  for (int panel = 0; panel < PANELS; ++panel) tma_load(dst + panel * panel_bytes, map, bar, 64 * panel, c1, c2, c3);
}

// Stores: one box from shared memory `src` to the tensor at the given coordinates (elements past
// the tensor's bounds are not written). Shared memory that ordinary stores wrote must be fenced
// first (fence_proxy_async_shared in each writing thread, then a barrier), because the copy
// reads it through the async proxy. Stores are tracked in bulk groups per thread: commit after
// issuing, then wait before reusing `src` (tma_store_wait_read) or before relying on the global
// writes (tma_store_wait).
__device__ __forceinline__ void tma_store(const TensorMap* map, const void* src, int c0, int c1) {
  asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%2, %3}], [%1];" ::"l"(map),
               "r"(smem_addr(src)), "r"(c0), "r"(c1)
               : "memory");
}
__device__ __forceinline__ void tma_store(const TensorMap* map, const void* src, int c0, int c1, int c2) {
  asm volatile("cp.async.bulk.tensor.3d.global.shared::cta.bulk_group [%0, {%2, %3, %4}], [%1];" ::"l"(map),
               "r"(smem_addr(src)), "r"(c0), "r"(c1), "r"(c2)
               : "memory");
}
__device__ __forceinline__ void tma_store(const TensorMap* map, const void* src, int c0, int c1, int c2, int c3) {
  asm volatile("cp.async.bulk.tensor.4d.global.shared::cta.bulk_group [%0, {%2, %3, %4, %5}], [%1];" ::"l"(map),
               "r"(smem_addr(src)), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
               : "memory");
}
// A bulk reduction: adds `bytes` (a multiple of 16) of fp32 values from shared memory `src` into
// global memory `dst` (both 16-byte aligned), element by element, in L2: one instruction for a
// whole tile instead of one reduction per thread and pair. Shared memory and bulk groups as for
// stores.
__device__ __forceinline__ void bulk_reduce_add_f32(float* dst, const void* src, u32 bytes) {
  asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;" ::"l"(dst),
               "r"(smem_addr(src)), "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void tma_store_commit() { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }
// At most N of this thread's committed store groups may still be reading their shared source.
template <int N>
__device__ __forceinline__ void tma_store_wait_read() {
  asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(N) : "memory");
}
// At most N of this thread's committed store groups may still be incomplete (global writes done).
template <int N>
__device__ __forceinline__ void tma_store_wait() {
  asm volatile("cp.async.bulk.wait_group %0;" ::"n"(N) : "memory");
}

}  // namespace sm90
}  // namespace cuflash

// Thread-block clusters (sm_90 and newer) for NVRTC kernels: the CTA's rank, the cluster barrier, and
// stores into a peer CTA's shared memory (distributed shared memory), as PTX. cooperative_groups'
// cluster API would do the same, but with CUDA 13 it includes CCCL headers (cuda/std/...) that NVRTC
// does not see through the toolkit's include directory alone. Include only from headers that are
// compiled for sm_90 or newer: the instructions do not exist before.
#pragma once

namespace kspec {

__device__ __forceinline__ unsigned cluster_ctarank() {
  unsigned r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return r;
}

__device__ __forceinline__ unsigned cluster_nctarank() {
  unsigned n;
  asm volatile("mov.u32 %0, %%cluster_nctarank;" : "=r"(n));
  return n;
}

// Every thread of every CTA of the cluster, warp-uniformly (the .aligned form). The arrive releases and
// the wait acquires at cluster scope, so shared (local and remote) and global writes made before it by
// any thread of the cluster are visible to every thread of the cluster after it: it also serves as
// the CTA's __syncthreads().
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}

// The shared::cluster address of `p` (a location in this CTA's shared memory) at the same offset in the
// shared memory of the cluster's CTA `rank` (this CTA's own rank included).
__device__ __forceinline__ unsigned cluster_map(const void* p, unsigned rank) {
  const unsigned local = static_cast<unsigned>(__cvta_generic_to_shared(p));
  unsigned remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(local), "r"(rank));
  return remote;
}

// A store into a shared::cluster address (cluster_map). Not ordered with anything but by cluster_sync().
__device__ __forceinline__ void cluster_store(unsigned addr, float v) {
  asm volatile("st.shared::cluster.f32 [%0], %1;" ::"r"(addr), "f"(v) : "memory");
}

}  // namespace kspec

// mlstm.step algo=cluster (sm_90 and newer; templates/mlstm/step.cuh has the other algorithms): algo=split's
// slab CTAs, each forming the step's scalars itself (its first warp runs the gates kernel's code:
// mlstm_step_gates_warp, the same values), so one launch and no wait on another grid. The slabs of a
// sequence are one thread-block cluster (grid.y = the cluster): n' and m' are written in place by its rank 0
// only after every CTA of the cluster has read n and m (a cluster barrier, arrived at once the scalars are
// formed and waited for at the end, so it costs the slowest slab's tail, not a round trip in the middle).
// Every output is algo=split's expression of the same operands in the same order: bitwise equal.
#pragma once

#include "common/cluster.cuh"
#include "mlstm/step.cuh"

namespace kspec {

template <typename T, typename TG, int kDk, int kDv, int kCols, int kThreads>
__global__ void __launch_bounds__(kThreads) mlstm_step_cluster_kernel(const MlstmParams p) {
  constexpr int kPer = (kDk + kWarpSize - 1) / kWarpSize;
  __shared__ MlstmStepScalars shared_sc;
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
  const long long seq = blockIdx.x;
  float nn[kPer];
  float m_new = 0.0f;
  mlstm_step_slab<T, kDk, kDv, kCols, kThreads>(p, [&]() {
    if (warp == 0) {
      const MlstmStepScalars sc = mlstm_step_gates_warp<T, TG, kDk>(p, seq, lane, nn);
      if (lane == 0) shared_sc = sc;
      m_new = sc.m_new;
    }
    __syncthreads();  // qs, ks and the scalars
    // This CTA has read n and m (warp 0, before the barrier): rank 0 may overwrite them once all have.
    asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory");
    return shared_sc;
  });
  asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory");
  if (warp == 0 && cluster_ctarank() == 0) mlstm_step_store_nm<kDk>(p, seq, lane, nn, m_new);
}

}  // namespace kspec

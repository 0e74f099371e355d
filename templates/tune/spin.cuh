// The tuner's stream filler: one thread waits `ns` nanoseconds of the GPU's global timer. Queued before
// a timed batch, it keeps the GPU busy while the host enqueues every call of the batch, so the CUDA
// events around the batch measure GPU time only, not the host's launch rate.
#pragma once

namespace kspec {

template <int kPollNs>
__global__ void tune_spin_kernel(unsigned long long ns) {
  unsigned long long start, now;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
  do {
    __nanosleep(kPollNs);
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
  } while (now - start < ns);
}

}  // namespace kspec

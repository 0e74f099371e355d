// gemm: y = act(x·Wᵀ + b) through cuBLASLt (a library op: no NVRTC kernel in the forward), batched,
// fp32/fp16/bf16 with fp32 accumulation, and its backward gemm.bwd (dx, dW, dbias; one NVRTC
// elementwise kernel for act'(pre) when there is an activation). Views of any transposition reach
// cuBLASLt without copies through gemm/layout.h.
#include "api/src/op.h"
#include "gemm/gemm_op.h"

namespace kspec {

void register_gemm(Registry& r) {
  r.add(gemm_op::make_fwd());
  r.add(gemm_op::make_bwd());
}

}  // namespace kspec

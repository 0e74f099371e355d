// What the mlstm family's two files share. schema.cpp: the tensors, params, dims, checks, tuning spaces
// and case tables of the five ops; op.cpp: the OpDefs (kernels, launchers, references).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "api/src/op.h"
#include "mlstm/reference.h"

namespace kspec::mlstm {

extern const std::vector<DType> kFloatTypes;
extern const std::vector<int64_t> kHeadDims;
extern const std::vector<int64_t> kChunks;
constexpr int64_t kDefaultChunk = 64;
// Shapes of the states (C, n, m) and of the per-step rows (i, f, nrm, m_rows).
extern const std::vector<std::string> kC, kN, kM, kRows;

inline unsigned u32(int64_t v) { return static_cast<unsigned>(v); }
std::string list(const std::vector<int64_t>& set);

// An op's common part: name, doc, dims (with seqlen when `seq`), check, tuning, dtypes, compile dims.
OpDef mlstm_base(const char* name, const char* doc, bool seq);
ParamDef eps_param();
ParamDef chunk_param();  // the chunkwise ops' `chunk`
TuningSpace mlstm_tuning(bool bwd = false);
// mlstm.chunkwise.fwd's space: the `algo` axis (kSimt: chunkwise_fwd.cuh, `threads` its CTA size; kTc:
// chunkwise_tc.cuh, its own block sizes, named with threads = 128) over mlstm_tuning's threads.
// The backward also has kTcFused: algo=tc with its dv and dk kernels as one (mlstm_tc_dkv_fused_kernel),
// and kTcParts: algo=tc without its dq and dk loops over DHHV's blocks (params.h, mlstm_tc_dq_loops: a
// CTA per block and fp32 partials, as before them), valid only where they differ, to compare; and
// kTcMerged: both state scans in one launch, and at DHQK <= 128 algo=tc's dq, dv, dk CTAs in one; above,
// dv looping over DHQK's blocks (no partials for dv); kTcStream (DHQK > 128 only, where it differs):
// kTcMerged with dq and dk streaming DHHV's blocks too (no partials at all, dq, dv, dk in one launch).
// kTcWide, both ops: the state scans on 128 x 128 tiles of C (params.h, mlstm_tc_wide_runs); in the
// backward with the default's kernels otherwise (kTcMerged, kTcStream at DHQK > 128). The forward's
// kTcQ128: the output kernel on 128 query rows a CTA (params.h, mlstm_tc_q128_runs); kTcWideQ128: both.
// The backward's kTcOverlap (kTcWideOverlap): kTcMerged's (kTcWide's) kernels with each gradient CTA's next
// tile loads in flight during its mma (params.h, mlstm_tc_overlap_runs: head dims <= 128) and the gates kernel
// by warps (params.h, kMlstmTcGatesWarps); the forward's kTcPg: kTc with that gates kernel; the backward's
// kTcWidePg: kTcWide with it.
enum FwdAlgo : int64_t {
  kSimt = 0, kTc = 1, kTcFused = 2, kTcParts = 3, kTcMerged = 4, kTcStream = 5, kTcWide = 6, kTcQ128 = 7,
  kTcWideQ128 = 8, kTcOverlap = 9, kTcWideOverlap = 10, kTcPg = 11, kTcWidePg = 12
};
TuningSpace chunkwise_fwd_tuning();
// mlstm.chunkwise.bwd's: the same axes and kTcFused, kTcParts, kTcMerged, kTcStream, kTcWide, kTcOverlap,
// kTcWideOverlap (named by a config only, to compare).
TuningSpace chunkwise_bwd_tuning();
// Why algo=tc_wide cannot run a problem ("" when it can), beyond tc_unsupported.
std::string tc_wide_unsupported(const Problem& p);
// Why the forward's output kernel cannot take 128 query rows a CTA (algo=tc_q128), beyond tc_unsupported.
std::string tc_q128_unsupported(const Problem& p);
// Why algo=tc cannot run a problem ("" when it can): 16-bit q, k, v, DHQK <= 256, 16-byte pointers
// (the backward the same: it cuts head dims over 128 into column blocks).
std::string tc_unsupported(const Problem& p);
TuningSpace parallel_tuning(bool bwd);  // chunk is a tuning axis
// mlstm.step's: `algo` kStepBlock (mlstm_step_kernel, one CTA of `threads` per sequence; named with
// cols = 16), kStepSplit (the gates kernel, then CTAs of `threads` over slabs of `cols` columns of C;
// 16-byte pointers) or kStepHead (mlstm_step_head_kernel: one CTA of `threads` per sequence, all of C in
// float4s and the scalars in the CTA, one launch; 16-byte pointers, named with cols = 16),
// templates/mlstm/step.cuh; or kStepCluster (sm_90+: split's slabs forming the scalars themselves, a
// sequence's slabs one thread-block cluster of at most kStepMaxCluster CTAs), templates/mlstm/step_cluster.cuh.
enum StepAlgo : int64_t { kStepBlock = 0, kStepSplit = 1, kStepHead = 2, kStepCluster = 3 };
constexpr int64_t kStepMaxCluster = 8;  // the portable cluster size
TuningSpace step_tuning();
// The heuristic's slab width (8, 16 or 32), which depends on batch * heads: in the step's derived_key, so
// the plan cache does not keep one batch's choice for another.
int64_t step_cols(const Problem& p);

// Inputs q, k, v, i, f with these leading dims; i and f in the input dtype or fp32.
std::vector<TensorDef> qkvif(const std::vector<std::string>& lead, const std::vector<std::string>& gate);
std::vector<TensorDef> bwd_inputs(bool chunkwise);
std::vector<TensorDef> bwd_outputs(bool chunkwise);

std::vector<Case> step_cases();
std::vector<Case> chunkwise_fwd_cases();
std::vector<Case> chunkwise_bwd_cases();
std::vector<Case> parallel_cases(bool bwd);

inline std::string gate_type(const Problem& p) { return dtype_cuda_type(p.dtype("f")); }
inline ref::MlstmShape shape_of_problem(const Problem& p, int64_t seqlen) {
  return {p.dim("batch"), p.dim("heads"), seqlen, p.dim("dhqk"), p.dim("dhhv")};
}
inline HostTensor host(const std::vector<int64_t>& shape, std::vector<double> data) {
  return {true, shape, std::move(data)};
}

}  // namespace kspec::mlstm

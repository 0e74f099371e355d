// Test data on the device, shared by the GPU checker (check.cpp) and the tuner (tune.cpp): random
// inputs drawn from an op's schema (never zeros), dtype conversion to and from bytes, device buffers,
// contiguous views and the relative error ‖a−b‖/‖b‖.
#pragma once

#include <cuda.h>

#include <cstdint>
#include <vector>

#include "api/src/op.h"
#include "jit/handles.h"

namespace kspec {

void encode(DType dt, const std::vector<double>& src, std::vector<unsigned char>& bytes);
std::vector<double> decode(DType dt, const std::vector<unsigned char>& bytes);
// Rounds values to what the dtype can hold, so the reference sees exactly the GPU's inputs. Integer
// dtypes (i32, i64) round to the nearest integer: valid int data is the op's prepare_inputs' business.
void quantize(DType dt, std::vector<double>& v);

// Inputs of a problem: N(0, 1) per element, rounded to each input's dtype, then the op's
// prepare_inputs (saved statistics, a stable state matrix...) and rounded again. for_timing: the tuner's
// inputs; an op whose OpDef::prepare_for_timing is false keeps its random values (see there).
std::vector<HostTensor> random_inputs(const OpDef& op, const Problem& p, uint64_t seed, bool for_timing = false);

using jit::DeviceBuffer;  // the device allocations of checks and tuning (jit/handles.h)

TensorView view_of(CUdeviceptr p, DType dt, const std::vector<int64_t>& shape, int device);

double rel_error(const std::vector<double>& out, const std::vector<double>& ref);
// The same over two buffers of one dtype, decoded element by element (no float64 copies): `out`
// against `ref`; infinity when `out` holds a non-finite value where `ref` does not.
double rel_error_bytes(DType dt, const std::vector<unsigned char>& out, const std::vector<unsigned char>& ref);

}  // namespace kspec

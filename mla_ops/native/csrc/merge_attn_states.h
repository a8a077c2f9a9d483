// The native merge's launch interface, shared by the CUDA kernel (merge_attn_states_kernel.cu, which
// includes no PyTorch header, so that nvcc compiles it in seconds) and the op (merge_attn_states.cpp).
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

namespace mla_native {

enum class OutputType : int { kBFloat16 = 0, kFloat16 = 1 };

// One merge: two partial results [T, H, Dv] (16-bit floats, unit stride along Dv) with their LSE
// [H, T] (float32, any strides), into a fresh contiguous out [T, H, Dv] and lse [H, T].
struct MergeArgs {
  const void* prefix_out;
  const float* prefix_lse;
  const void* suffix_out;
  const float* suffix_lse;
  void* out;
  float* lse;
  int64_t num_tokens;
  int64_t num_heads;
  int64_t head_dim;
  int64_t prefix_out_stride_t;
  int64_t prefix_out_stride_h;
  int64_t suffix_out_stride_t;
  int64_t suffix_out_stride_h;
  int64_t prefix_lse_stride_h;
  int64_t prefix_lse_stride_t;
  int64_t suffix_lse_stride_h;
  int64_t suffix_lse_stride_t;
  bool prefix_lse_base2;  // that side's LSE is log2 of its sum: converted as it is loaded
  bool suffix_lse_base2;
};

// Launches the merge on `stream` (of the current device); returns cudaGetLastError() after the launch.
cudaError_t launch_merge(OutputType type, const MergeArgs& args, cudaStream_t stream);

}  // namespace mla_native

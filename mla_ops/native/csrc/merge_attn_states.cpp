// The CUDA kernel of mla::merge_attn_states, in C++: the op's whole eager call (checks, two outputs,
// one launch) without a Python frame. mla_ops.native builds this file with the CUDA kernel
// (merge_attn_states_kernel.cu) on first use and loads it; loading registers:
//
// - mla::merge_attn_states for the CUDA key, over the Python kernel that mla_ops.ops registers for
//   every backend key (CompositeExplicitAutograd), which the CUDA key then no longer reaches;
// - mla_native::merge_attn_states, the same merge with two flags that mark a side's LSE as base 2,
//   which the package's fused layer op calls.
//
// The checks are mla_ops.meta.checks.merge_tensors_are_valid, term for term. Inputs it refuses go to
// mla::_check_merge_inputs (mla_ops.meta.checks.check_merge_inputs), which raises the op's error: one
// place for every message.

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/cuda/EmptyTensor.h>
#include <c10/core/GradMode.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <optional>
#include <tuple>

#include "merge_attn_states.h"

namespace mla_native {
namespace {

bool inputs_are_valid(const at::Tensor& prefix_out, const at::Tensor& prefix_lse, const at::Tensor& suffix_out,
                      const at::Tensor& suffix_lse) {
  // An undefined tensor (None for a Tensor argument) goes to the Python check, which names the argument.
  if (!prefix_out.defined() || !prefix_lse.defined() || !suffix_out.defined() || !suffix_lse.defined()) return false;
  if (prefix_out.dim() != 3) return false;
  const auto dtype = prefix_out.scalar_type();
  const auto sizes = prefix_out.sizes();
  const auto device = prefix_out.device();
  const bool empty = sizes[0] == 0 || sizes[1] == 0 || sizes[2] == 0;
  return (dtype == at::kBFloat16 || dtype == at::kHalf) && suffix_out.scalar_type() == dtype &&
         suffix_out.sizes() == sizes && prefix_lse.scalar_type() == at::kFloat &&
         suffix_lse.scalar_type() == at::kFloat && prefix_lse.dim() == 2 && prefix_lse.size(0) == sizes[1] &&
         prefix_lse.size(1) == sizes[0] && suffix_lse.dim() == 2 && suffix_lse.size(0) == sizes[1] &&
         suffix_lse.size(1) == sizes[0] && suffix_out.device() == device && prefix_lse.device() == device &&
         suffix_lse.device() == device && (empty || (prefix_out.stride(2) == 1 && suffix_out.stride(2) == 1)) &&
         !(c10::GradMode::is_enabled() && (prefix_out.requires_grad() || suffix_out.requires_grad()));
}

[[noreturn]] void raise_for(const at::Tensor& prefix_out, const at::Tensor& prefix_lse, const at::Tensor& suffix_out,
                            const at::Tensor& suffix_lse) {
  static const auto check = c10::Dispatcher::singleton()
                                .findSchemaOrThrow("mla::_check_merge_inputs", "")
                                .typed<void(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                            const at::Tensor&)>();
  check.call(prefix_out, prefix_lse, suffix_out, suffix_lse);
  TORCH_CHECK(false,
              "mla.merge_attn_states: the native kernel refused inputs that mla_ops' input check accepts "
              "(a bug in mla_ops: please report it with the inputs' shapes, strides, dtypes and devices); "
              "set MLA_OPS_NATIVE=0 to run the Triton merge meanwhile (it turns the whole native library off)");
}

std::tuple<at::Tensor, at::Tensor> merge(const at::Tensor& prefix_out, const at::Tensor& prefix_lse,
                                         const at::Tensor& suffix_out, const at::Tensor& suffix_lse,
                                         bool prefix_lse_base2, bool suffix_lse_base2) {
  if (!inputs_are_valid(prefix_out, prefix_lse, suffix_out, suffix_lse)) {
    raise_for(prefix_out, prefix_lse, suffix_out, suffix_lse);
  }
  const int64_t num_tokens = prefix_out.size(0);
  const int64_t num_heads = prefix_out.size(1);
  const int64_t head_dim = prefix_out.size(2);
  const c10::Device device = prefix_out.device();
  // The launch goes to the current device: make it the tensors' (a no-op when it is already).
  const c10::cuda::CUDAGuard guard(device);
  at::Tensor out = at::detail::empty_cuda({num_tokens, num_heads, head_dim}, prefix_out.scalar_type(), device,
                                          std::nullopt);
  at::Tensor lse = at::detail::empty_cuda({num_heads, num_tokens}, at::kFloat, device, std::nullopt);
  if (out.numel() == 0) return {std::move(out), std::move(lse)};
  const MergeArgs args{
      prefix_out.const_data_ptr(),
      prefix_lse.const_data_ptr<float>(),
      suffix_out.const_data_ptr(),
      suffix_lse.const_data_ptr<float>(),
      out.mutable_data_ptr(),
      lse.mutable_data_ptr<float>(),
      num_tokens,
      num_heads,
      head_dim,
      prefix_out.stride(0),
      prefix_out.stride(1),
      suffix_out.stride(0),
      suffix_out.stride(1),
      prefix_lse.stride(0),
      prefix_lse.stride(1),
      suffix_lse.stride(0),
      suffix_lse.stride(1),
      prefix_lse_base2,
      suffix_lse_base2,
  };
  const OutputType type = prefix_out.scalar_type() == at::kBFloat16 ? OutputType::kBFloat16 : OutputType::kFloat16;
  C10_CUDA_CHECK(launch_merge(type, args, c10::cuda::getCurrentCUDAStream(device.index()).stream()));
  return {std::move(out), std::move(lse)};
}

std::tuple<at::Tensor, at::Tensor> merge_attn_states(const at::Tensor& prefix_out, const at::Tensor& prefix_lse,
                                                     const at::Tensor& suffix_out, const at::Tensor& suffix_lse) {
  return merge(prefix_out, prefix_lse, suffix_out, suffix_lse, false, false);
}

}  // namespace
}  // namespace mla_native

TORCH_LIBRARY(mla_native, m) {
  m.def(
      "merge_attn_states(Tensor prefix_out, Tensor prefix_lse, Tensor suffix_out, Tensor suffix_lse, "
      "bool prefix_lse_base2=False, bool suffix_lse_base2=False) -> (Tensor out, Tensor lse)");
}

TORCH_LIBRARY_IMPL(mla_native, CUDA, m) { m.impl("merge_attn_states", &mla_native::merge); }

TORCH_LIBRARY_IMPL(mla, CUDA, m) { m.impl("merge_attn_states", &mla_native::merge_attn_states); }

// The native merge of two partial attention results through their log-sum-exp. For each token t and
// head h, with a = prefix_lse[h, t] and b = suffix_lse[h, t] (natural log):
//
//   m   = max(a, b)
//   out = (prefix_out * exp(a - m) + suffix_out * exp(b - m)) / (exp(a - m) + exp(b - m))
//   lse = m + log(exp(a - m) + exp(b - m))
//
// +inf and -inf both mark a side without keys: it gets weight 0 and its output is not read (NaN there
// cannot leak). Both sides empty give out = 0 and lse = -inf; a NaN LSE on either side gives NaN in
// out and lse. These are the Triton merge's rules (mla_ops/kernels/merge.py), and its arithmetic: exp
// as ex2.approx of x * log2(e) (__expf, what Triton emits for a float32 tl.exp), accurate log, the
// weights as w * (1 / total), the base-2 conversion as one rounded multiply by ln 2.
//
// One thread per VEC-wide pack of one output row: consecutive threads cover a row, then the next
// head, so loads and stores of the [T, H, Dv] tensors are contiguous 16-byte vectors for Dv = 128.
// This file includes no PyTorch header: nvcc compiles it in seconds.

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <climits>
#include <cstdint>

#include "merge_attn_states.h"

namespace mla_native {
namespace {

constexpr int kThreads = 256;
constexpr float kLn2 = 0.6931471805599453f;
// Blocks of one launch at most: the grid-stride loop covers the rest, and the unsigned 32-bit index
// cannot wrap while the stride stays below 2^30.
constexpr int64_t kMaxBlocks = (int64_t{1} << 30) / kThreads;

// Conversions through the intrinsics, not the types' operators: PyTorch's extension builder compiles
// with __CUDA_NO_HALF_CONVERSIONS__ and __CUDA_NO_BFLOAT16_CONVERSIONS__, which remove those. One
// specialization per element type holds both directions.
template <typename T>
struct Convert;
template <>
struct Convert<__nv_bfloat16> {
  static __device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
  static __device__ __forceinline__ __nv_bfloat16 from_float(float x) { return __float2bfloat16_rn(x); }
};
template <>
struct Convert<__half> {
  static __device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
  static __device__ __forceinline__ __half from_float(float x) { return __float2half_rn(x); }
};

template <typename T, int VEC>
struct alignas(sizeof(T) * VEC) Pack {
  T v[VEC];
};

// The weights of the two sides and the merged LSE, from the two sides' LSE.
__device__ __forceinline__ void merge_weights(float a, float b, float& wa, float& wb, float& lse) {
  // +inf marks an empty side too (some kernels write it for rows without keys).
  a = a == INFINITY ? -INFINITY : a;
  b = b == INFINITY ? -INFINITY : b;
  float m = fmaxf(a, b);  // the other side where one is NaN; the NaN side's weight is NaN below
  m = m == -INFINITY ? 0.0f : m;  // both empty: exp(-inf - 0) = 0, not NaN
  const float ea = __expf(a - m);
  const float eb = __expf(b - m);
  const float total = ea + eb;
  // `total == 0` (not `total > 0`), so that a NaN LSE on either side gives a NaN row, never -inf.
  const bool empty = total == 0.0f;
  lse = empty ? -INFINITY : m + logf(total);
  const float inv = 1.0f / (empty ? 1.0f : total);
  wa = ea * inv;
  wb = eb * inv;
}

template <typename T, int VEC, typename Index>
__global__ void __launch_bounds__(kThreads) merge_kernel(const MergeArgs args) {
  using P = Pack<T, VEC>;
  using C = Convert<T>;
  const Index packs_per_row = static_cast<Index>(args.head_dim / VEC);
  const Index num_heads = static_cast<Index>(args.num_heads);
  const Index total = static_cast<Index>(args.num_tokens) * num_heads * packs_per_row;
  const T* prefix_out = static_cast<const T*>(args.prefix_out);
  const T* suffix_out = static_cast<const T*>(args.suffix_out);
  T* out = static_cast<T*>(args.out);
  const Index stride = static_cast<Index>(gridDim.x) * kThreads;
  for (Index i = static_cast<Index>(blockIdx.x) * kThreads + threadIdx.x; i < total; i += stride) {
    const Index pack = i % packs_per_row;
    const Index row = i / packs_per_row;
    const int64_t h = static_cast<int64_t>(row % num_heads);
    const int64_t t = static_cast<int64_t>(row / num_heads);
    float a = args.prefix_lse[h * args.prefix_lse_stride_h + t * args.prefix_lse_stride_t];
    float b = args.suffix_lse[h * args.suffix_lse_stride_h + t * args.suffix_lse_stride_t];
    // A base-2 LSE (a library's own, handed over unconverted) becomes natural log here: one rounded
    // multiply (no fused multiply-add with what follows), so the result equals converting first.
    if (args.prefix_lse_base2) a = __fmul_rn(a, kLn2);
    if (args.suffix_lse_base2) b = __fmul_rn(b, kLn2);
    float wa, wb, lse;
    merge_weights(a, b, wa, wb, lse);
    if (pack == 0) args.lse[h * args.num_tokens + t] = lse;

    const int64_t channel = static_cast<int64_t>(pack) * VEC;
    // A side of weight 0 is not read: an empty side's output may hold anything, NaN included. A NaN
    // weight is not 0, so a NaN LSE still reaches the sum (0 * NaN) and makes the row NaN.
    P po{}, so{};
    if (wa != 0.0f) {
      po = *reinterpret_cast<const P*>(prefix_out + t * args.prefix_out_stride_t + h * args.prefix_out_stride_h + channel);
    }
    if (wb != 0.0f) {
      so = *reinterpret_cast<const P*>(suffix_out + t * args.suffix_out_stride_t + h * args.suffix_out_stride_h + channel);
    }
    P result;
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      result.v[j] = C::from_float(C::to_float(po.v[j]) * wa + C::to_float(so.v[j]) * wb);
    }
    *reinterpret_cast<P*>(out + (t * num_heads + h) * args.head_dim + channel) = result;
  }
}

// The widest pack (16 bytes at most) that every row of the three [T, H, Dv] tensors starts on.
template <typename T>
int pack_width(const MergeArgs& args) {
  for (int vec = 16 / static_cast<int>(sizeof(T)); vec > 1; vec /= 2) {
    const int64_t bytes = vec * static_cast<int64_t>(sizeof(T));
    const bool aligned = reinterpret_cast<uintptr_t>(args.prefix_out) % bytes == 0 &&
                         reinterpret_cast<uintptr_t>(args.suffix_out) % bytes == 0 &&
                         reinterpret_cast<uintptr_t>(args.out) % bytes == 0;
    const bool whole = args.head_dim % vec == 0 && args.prefix_out_stride_t % vec == 0 &&
                       args.prefix_out_stride_h % vec == 0 && args.suffix_out_stride_t % vec == 0 &&
                       args.suffix_out_stride_h % vec == 0;
    if (aligned && whole) return vec;
  }
  return 1;
}

template <typename T, int VEC>
cudaError_t launch_packed(const MergeArgs& args, cudaStream_t stream) {
  const int64_t total = args.num_tokens * args.num_heads * (args.head_dim / VEC);
  if (total == 0) return cudaSuccess;
  const int64_t blocks = (total + kThreads - 1) / kThreads;
  const dim3 grid(static_cast<unsigned>(blocks < kMaxBlocks ? blocks : kMaxBlocks));
  // 32-bit index arithmetic where it fits: the division and modulo per thread are 64-bit otherwise.
  if (total <= INT32_MAX) {
    merge_kernel<T, VEC, uint32_t><<<grid, kThreads, 0, stream>>>(args);
  } else {
    merge_kernel<T, VEC, uint64_t><<<grid, kThreads, 0, stream>>>(args);
  }
  return cudaGetLastError();
}

template <typename T>
cudaError_t launch_typed(const MergeArgs& args, cudaStream_t stream) {
  switch (pack_width<T>(args)) {
    case 8:
      return launch_packed<T, 8>(args, stream);
    case 4:
      return launch_packed<T, 4>(args, stream);
    case 2:
      return launch_packed<T, 2>(args, stream);
    default:
      return launch_packed<T, 1>(args, stream);
  }
}

}  // namespace

cudaError_t launch_merge(OutputType type, const MergeArgs& args, cudaStream_t stream) {
  return type == OutputType::kBFloat16 ? launch_typed<__nv_bfloat16>(args, stream)
                                       : launch_typed<__half>(args, stream);
}

}  // namespace mla_native

// The CUDA kernels of mla::prefill and mla::prefill_context_chunk, in C++: a call whose inputs have the
// layout of an earlier call that ran the TRITON backend repeats that call's launch of the compiled Triton
// kernel (two outputs and one cuLaunchKernel, no Python frame; for the Hopper Gluon kernel also one zeroed
// workspace, its work counter and global scratch); every other call runs the ops' Python
// kernels (mla::_prefill_python, mla::_prefill_context_chunk_python), as it would without this file.
//
// mla_ops.native builds this file with the native merge and loads it; mla_ops.ops, after a TRITON call
// through the Python kernel, hands the launch it made to mla_native::remember_attention, with the inputs,
// and the inputs' layout names it from then on. A layout is everything the Python kernel's input check,
// its routing and the Triton kernel's launch read of the inputs: every tensor's sizes, strides, dtype,
// device and 16-byte alignment, the two bounds and the softmax scale. Inputs of a remembered layout pass the
// check (it read nothing else when it accepted them) and route to TRITON (mla_ops.selector.clear_cache,
// the only way a routing changes, calls mla_native::forget_attention), and the launch of the layout is
// the one Triton made for them with only the addresses changed, as the Python kernel repeats it too
// (mla_ops.kernels.launch.FixedLaunch). Three facts outside the inputs are read on every call: whether
// gradients are recorded for an input (the check refuses that), which device is current (launches
// go there) and MLA_OPS_TRITON_CONFIG's text (it picks the kernel variant). Calls with Triton's launch
// hooks installed (profilers such as Proton add them) go to the Python kernel, which calls the hooks.
//
// mla::prefill_with_chunk, the fused op of a layer's new tokens and one context chunk, gets a C++ kernel
// too: where both parts' layouts are remembered (as the prefill and prefill_context_chunk layouts they
// are) it launches both and merges them with the native merge, as its Python kernel
// (mla::_prefill_with_chunk_python) does for TRITON; every other call goes to that kernel.

#include <Python.h>  // first, as Python asks: it sets feature macros the system headers read

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/cuda/EmptyTensor.h>
#include <c10/core/GradMode.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/string_view.h>
#include <cuda.h>
#include <dlfcn.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <unordered_map>
#include <vector>

namespace mla_native {
namespace {

using Outputs = std::tuple<at::Tensor, at::Tensor>;

// The tensors a launch passes by address, in the order of the codes that mla_ops.kernels.attention
// gives them (NATIVE_TENSOR_CODES there), and kCounter: a fresh zeroed int32 per launch, the Hopper Gluon
// kernel's work counter (mla_ops.kernels.launch.NATIVE_COUNTER_CODE).
enum TensorCode : int64_t { kQ = 0, kK, kV, kOut, kLse, kCuQ, kCuK, kCounter, kTensorCodes };

// Where the zeroed per-launch workspace puts Triton's global scratch: after the counter, on the caching
// allocator's 512-byte alignment (mla_ops.kernels.launch: a native launch needs no more).
constexpr int64_t kScratchOffset = 512;

// How a kernel parameter is stored (mla_ops.kernels.launch.NATIVE_KINDS): a tensor's address, or a
// value of one of Triton's scalar types.
enum ParamKind : int64_t { kPointer = 0, kI32, kI64, kF32Bits, kI8, kI16, kU32, kU64, kParamKinds };

constexpr size_t kMaxParams = 64;  // the attention kernel has 31
constexpr size_t kMaxLayouts = 4096;  // past this many the table starts over, as the Python one does

// What names a layout: see the file's comment. 1 + 3 * 10 + 2 * 6 + 3 fields.
using Key = std::array<int64_t, 46>;

struct KeyHash {
  size_t operator()(const Key& key) const noexcept {
    uint64_t h = 1469598103934665603ull;  // FNV-1a over the fields
    for (int64_t field : key) {
      h ^= static_cast<uint64_t>(field);
      h *= 1099511628211ull;
    }
    return static_cast<size_t>(h);
  }
};

int64_t address_alignment(const at::Tensor& t) {
  return reinterpret_cast<uintptr_t>(t.const_data_ptr()) % 16 == 0;
}

// The layout of a call's inputs, or nothing for tensors of another rank (the check refuses those).
std::optional<Key> layout_of(int64_t op, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                             const at::Tensor& cu_q, const at::Tensor& cu_k, int64_t max_q, int64_t max_k,
                             double scale) {
  // Undefined tensors (None for a Tensor argument) too: the Python kernel's check names the argument.
  if (!q.defined() || !k.defined() || !v.defined() || !cu_q.defined() || !cu_k.defined()) return std::nullopt;
  if (q.dim() != 3 || k.dim() != 3 || v.dim() != 3 || cu_q.dim() != 1 || cu_k.dim() != 1) return std::nullopt;
  Key key{};
  size_t i = 0;
  key[i++] = op;
  for (const at::Tensor* t : {&q, &k, &v}) {
    const auto sizes = t->sizes();
    const auto strides = t->strides();
    for (int d = 0; d < 3; ++d) key[i++] = sizes[d];
    for (int d = 0; d < 3; ++d) key[i++] = strides[d];
    key[i++] = static_cast<int64_t>(t->scalar_type());
    key[i++] = static_cast<int64_t>(t->device().type());
    key[i++] = t->device().index();
    key[i++] = address_alignment(*t);
  }
  for (const at::Tensor* t : {&cu_q, &cu_k}) {
    key[i++] = t->size(0);
    key[i++] = t->stride(0);
    key[i++] = static_cast<int64_t>(t->scalar_type());
    key[i++] = static_cast<int64_t>(t->device().type());
    key[i++] = t->device().index();
    key[i++] = address_alignment(*t);
  }
  key[i++] = max_q;
  key[i++] = max_k;
  int64_t scale_bits;
  static_assert(sizeof(scale_bits) == sizeof(scale), "a double is 8 bytes");
  std::memcpy(&scale_bits, &scale, sizeof(scale));
  key[i++] = scale_bits;
  return key;
}

// One remembered launch: the compiled kernel, its grid, and its parameters with the addresses left out.
struct Launch {
  CUfunction function;
  unsigned grid[3];
  unsigned block;
  unsigned shared_bytes;
  std::vector<uint64_t> params;  // one 8-byte word per parameter, its value in the low bytes
  std::vector<std::pair<size_t, int64_t>> addresses;  // (parameter, TensorCode) to fill per call
  int64_t head_dim_v;
  c10::DeviceIndex device;
  std::optional<std::string> config;  // MLA_OPS_TRITON_CONFIG's text when it was launched
  int64_t scratch_bytes = 0;  // the kernel's global scratch for the whole grid (0: none, passed null)
  bool counted = false;  // whether a parameter is kCounter
};

std::mutex table_mutex;
std::unordered_map<Key, std::shared_ptr<const Launch>, KeyHash> table;
std::atomic<bool> table_empty{true};

std::shared_ptr<const Launch> find(const Key& key) {
  const std::lock_guard<std::mutex> lock(table_mutex);
  const auto it = table.find(key);
  return it == table.end() ? nullptr : it->second;
}

using LaunchKernel = CUresult (*)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                                  CUstream, void**, void**);
using ErrorString = CUresult (*)(CUresult, const char**);
using MemsetAsync = CUresult (*)(CUdeviceptr, unsigned char, size_t, CUstream);

// The driver's cuLaunchKernel, found in libcuda as Triton's own launcher finds it (no link-time
// dependency on the driver library).
struct Driver {
  LaunchKernel launch = nullptr;
  ErrorString error_string = nullptr;
  MemsetAsync memset = nullptr;  // cuMemsetD8Async: the Gluon kernel's zeroed workspace
  Driver() {
    void* library = dlopen("libcuda.so.1", RTLD_LAZY | RTLD_NOLOAD);
    if (library == nullptr) library = dlopen("libcuda.so.1", RTLD_LAZY);
    if (library == nullptr) return;
    launch = reinterpret_cast<LaunchKernel>(dlsym(library, "cuLaunchKernel"));
    error_string = reinterpret_cast<ErrorString>(dlsym(library, "cuGetErrorString"));
    memset = reinterpret_cast<MemsetAsync>(dlsym(library, "cuMemsetD8Async"));
  }
};

const Driver& driver() {
  static const Driver instance;
  return instance;
}

// A driver call's failure as the package's error: what failed, the driver's text, and the way around it.
void check_driver(CUresult result, const char* what) {
  if (result == CUDA_SUCCESS) return;
  const char* text = "unknown error";
  if (driver().error_string != nullptr) driver().error_string(result, &text);
  TORCH_CHECK(false, "mla_ops: ", what, " failed (", text,
              "); set MLA_OPS_NATIVE_LAUNCH=0 to launch it through Triton instead, and please report this "
              "with the inputs' shapes, strides and dtypes");
}

// Whether Triton's launch hooks are installed: mla_ops.kernels.launch._hooks's test, on the same objects.
bool triton_hooks_installed() {
  const PyGILState_STATE gil = PyGILState_Ensure();
  static PyObject* runtime = nullptr;  // triton.knobs.runtime, kept for the process
  static bool looked = false;
  if (!looked) {
    looked = true;
    PyObject* knobs = PyImport_ImportModule("triton.knobs");
    if (knobs != nullptr) {
      runtime = PyObject_GetAttrString(knobs, "runtime");
      Py_DECREF(knobs);
    }
  }
  bool installed = runtime == nullptr;  // where the hooks cannot be read, the Python kernel decides
  for (const char* name : {"launch_enter_hook", "launch_exit_hook"}) {
    if (installed) break;
    PyObject* hook = PyObject_GetAttrString(runtime, name);
    if (hook == nullptr) {
      installed = true;
    } else if (hook != Py_None) {
      // A HookChain with no calls is no hook; anything else is one.
      PyObject* calls = PyObject_GetAttrString(hook, "calls");
      installed = calls == nullptr || PyObject_IsTrue(calls) != 0;
      Py_XDECREF(calls);
    }
    Py_XDECREF(hook);
  }
  PyErr_Clear();
  PyGILState_Release(gil);
  return installed;
}

bool config_unchanged(const std::optional<std::string>& config) {
  const char* now = std::getenv("MLA_OPS_TRITON_CONFIG");
  return now == nullptr ? !config.has_value() : config.has_value() && *config == now;
}

// The remembered launch of these inputs' layout where the facts outside the inputs let it run (gradients
// not recorded, its device current, the same MLA_OPS_TRITON_CONFIG); the caller asks about Triton's hooks.
std::shared_ptr<const Launch> launchable(int64_t op, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                         const at::Tensor& cu_q, const at::Tensor& cu_k, int64_t max_q, int64_t max_k,
                                         double scale) {
  if (table_empty.load(std::memory_order_relaxed)) return nullptr;
  const std::optional<Key> key = layout_of(op, q, k, v, cu_q, cu_k, max_q, max_k, scale);
  if (!key) return nullptr;
  std::shared_ptr<const Launch> launch = find(*key);
  if (launch == nullptr) return nullptr;
  if (c10::GradMode::is_enabled() && (q.requires_grad() || k.requires_grad() || v.requires_grad())) return nullptr;
  if (c10::cuda::current_device() != launch->device || !config_unchanged(launch->config)) return nullptr;
  return launch;
}

// The remembered launch for these inputs, or nothing where the Python kernel has to run.
std::shared_ptr<const Launch> remembered(int64_t op, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                         const at::Tensor& cu_q, const at::Tensor& cu_k, int64_t max_q, int64_t max_k,
                                         double scale) {
  std::shared_ptr<const Launch> launch = launchable(op, q, k, v, cu_q, cu_k, max_q, max_k, scale);
  return launch == nullptr || triton_hooks_installed() ? nullptr : launch;
}

Outputs run(const Launch& launch, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
            const at::Tensor& cu_q, const at::Tensor& cu_k) {
  const int64_t num_tokens = q.size(0);
  const int64_t num_heads = q.size(1);
  const c10::Device device = q.device();
  at::Tensor out =
      at::detail::empty_cuda({num_tokens, num_heads, launch.head_dim_v}, q.scalar_type(), device, std::nullopt);
  at::Tensor lse = at::detail::empty_cuda({num_heads, num_tokens}, at::kFloat, device, std::nullopt);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device.index()).stream();
  // The Gluon kernel's work counter and global scratch: one zeroed block per launch from the caching allocator
  // on this stream (a graph's pool and a memset node during capture), as the Python launch allocates them; it is
  // freed after the launch is queued, which the stream orders before any reuse.
  at::Tensor workspace;
  const void* counter = nullptr;
  CUdeviceptr scratch = 0;
  if (launch.counted || launch.scratch_bytes > 0) {
    const int64_t bytes = kScratchOffset + launch.scratch_bytes;
    workspace = at::detail::empty_cuda({bytes}, at::kByte, device, std::nullopt);
    counter = workspace.const_data_ptr();
    check_driver(driver().memset(reinterpret_cast<CUdeviceptr>(counter), 0, static_cast<size_t>(bytes), stream),
                 "zeroing the TRITON attention kernel's workspace");
    if (launch.scratch_bytes > 0) scratch = reinterpret_cast<CUdeviceptr>(counter) + kScratchOffset;
  }
  const std::array<const void*, kTensorCodes> tensors{q.const_data_ptr(),   k.const_data_ptr(),
                                                       v.const_data_ptr(),   out.const_data_ptr(),
                                                       lse.const_data_ptr(), cu_q.const_data_ptr(),
                                                       cu_k.const_data_ptr(), counter};
  const size_t count = launch.params.size();
  std::array<uint64_t, kMaxParams> words;
  std::copy(launch.params.begin(), launch.params.end(), words.begin());
  for (const auto& [param, code] : launch.addresses) words[param] = reinterpret_cast<uintptr_t>(tensors[code]);
  // Triton's kernels take two more parameters, the global and the profile scratch buffers: the workspace's
  // scratch where the kernel has global scratch, else null; the profile one always null (a kernel that needs
  // one is never remembered).
  CUdeviceptr no_scratch = 0;
  std::array<void*, kMaxParams + 2> params;
  for (size_t i = 0; i < count; ++i) params[i] = &words[i];
  params[count] = &scratch;
  params[count + 1] = &no_scratch;
  check_driver(driver().launch(launch.function, launch.grid[0], launch.grid[1], launch.grid[2], launch.block, 1, 1,
                               launch.shared_bytes, stream, params.data(), nullptr),
               "launching the TRITON attention kernel");
  return {std::move(out), std::move(lse)};
}

Outputs prefill(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cu_seqlens,
                c10::SymInt max_seqlen, double softmax_scale) {
  const int64_t bound = max_seqlen.expect_int();
  if (auto launch = remembered(0, q, k, v, cu_seqlens, cu_seqlens, bound, bound, softmax_scale)) {
    return run(*launch, q, k, v, cu_seqlens, cu_seqlens);
  }
  static const auto python = c10::Dispatcher::singleton()
                                 .findSchemaOrThrow("mla::_prefill_python", "")
                                 .typed<Outputs(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                const at::Tensor&, c10::SymInt, double)>();
  return python.call(q, k, v, cu_seqlens, std::move(max_seqlen), softmax_scale);
}

Outputs prefill_context_chunk(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                              const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k,
                              c10::SymInt max_seqlen_q, c10::SymInt max_seqlen_k, double softmax_scale) {
  if (auto launch = remembered(1, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q.expect_int(),
                               max_seqlen_k.expect_int(), softmax_scale)) {
    return run(*launch, q, k, v, cu_seqlens_q, cu_seqlens_k);
  }
  static const auto python =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("mla::_prefill_context_chunk_python", "")
          .typed<Outputs(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                         const at::Tensor&, c10::SymInt, c10::SymInt, double)>();
  return python.call(q, k, v, cu_seqlens_q, cu_seqlens_k, std::move(max_seqlen_q), std::move(max_seqlen_k),
                     softmax_scale);
}

// The fused op's parts are checked as the two ops check them, so a part whose layout is remembered under
// its op passed that op's check; what the fused op checks beyond them is that the chunk's values are as
// wide as the new tokens' (mla_ops.meta.checks.check_chunk_values), read here before anything launches.
Outputs prefill_with_chunk(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cu_seqlens,
                           c10::SymInt max_seqlen, const at::Tensor& k_chunk, const at::Tensor& v_chunk,
                           const at::Tensor& cu_seqlens_k, c10::SymInt max_seqlen_k, double softmax_scale) {
  if (v.defined() && v_chunk.defined() && v.dim() == 3 && v_chunk.dim() == 3 && v.size(2) == v_chunk.size(2)) {
    const int64_t bound = max_seqlen.expect_int();
    const int64_t bound_k = max_seqlen_k.expect_int();
    auto causal = launchable(0, q, k, v, cu_seqlens, cu_seqlens, bound, bound, softmax_scale);
    auto chunk = causal == nullptr ? nullptr
                                   : launchable(1, q, k_chunk, v_chunk, cu_seqlens, cu_seqlens_k, bound, bound_k,
                                                softmax_scale);
    if (chunk != nullptr && !triton_hooks_installed()) {
      auto [out, lse] = run(*causal, q, k, v, cu_seqlens, cu_seqlens);
      auto [out_chunk, lse_chunk] = run(*chunk, q, k_chunk, v_chunk, cu_seqlens, cu_seqlens_k);
      // The Python kernel's merge: the chunk as the prefix, the new tokens as the suffix, natural-log LSEs.
      static const auto merge = c10::Dispatcher::singleton()
                                    .findSchemaOrThrow("mla_native::merge_attn_states", "")
                                    .typed<Outputs(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                   const at::Tensor&, bool, bool)>();
      return merge.call(out_chunk, lse_chunk, out, lse, false, false);
    }
  }
  static const auto python = c10::Dispatcher::singleton()
                                 .findSchemaOrThrow("mla::_prefill_with_chunk_python", "")
                                 .typed<Outputs(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                const at::Tensor&, c10::SymInt, const at::Tensor&, const at::Tensor&,
                                                const at::Tensor&, c10::SymInt, double)>();
  return python.call(q, k, v, cu_seqlens, std::move(max_seqlen), k_chunk, v_chunk, cu_seqlens_k,
                     std::move(max_seqlen_k), softmax_scale);
}

// mla_native::remember_attention: see mla_ops.native.remember_attention, which calls it.
// The C++ kernels take the attention ops' CUDA key only while a layout is remembered: a process whose calls
// never run TRITON (FLASHINFER, FLASH_ATTN) keeps the ops' Python kernels on that key, and pays no hop through
// this file. The registration is a torch::Library of our own, made by the first remembered layout and
// destroyed (which unregisters its kernels) when the table is forgotten.
std::mutex registration_mutex;
std::unique_ptr<torch::Library> kernels;

void register_kernels() {
  const std::lock_guard<std::mutex> lock(registration_mutex);
  if (kernels != nullptr) return;
  auto library = std::make_unique<torch::Library>(torch::Library::IMPL, "mla", c10::DispatchKey::CUDA, __FILE__,
                                                  static_cast<uint32_t>(__LINE__));
  library->impl("prefill", TORCH_FN(prefill));
  library->impl("prefill_context_chunk", TORCH_FN(prefill_context_chunk));
  library->impl("prefill_with_chunk", TORCH_FN(prefill_with_chunk));
  kernels = std::move(library);
}

void unregister_kernels() {
  const std::lock_guard<std::mutex> lock(registration_mutex);
  kernels.reset();
}

void remember_attention(int64_t op, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                        const at::Tensor& cu_q, const at::Tensor& cu_k, int64_t max_q, int64_t max_k, double scale,
                        int64_t function, at::IntArrayRef grid, int64_t block, int64_t shared_bytes,
                        at::IntArrayRef kinds, at::IntArrayRef values, std::optional<c10::string_view> config,
                        int64_t scratch_bytes) {
  TORCH_CHECK(op == 0 || op == 1, "remember_attention: op is 0 (prefill) or 1 (prefill_context_chunk), got ", op);
  TORCH_CHECK(grid.size() == 3 && kinds.size() == values.size() && kinds.size() <= kMaxParams,
              "remember_attention: a grid of 3 and as many values as kinds (at most ", kMaxParams, ") are needed");
  TORCH_CHECK(q.is_cuda() && q.dim() == 3 && v.dim() == 3, "remember_attention: q and v are CUDA [T, H, D] tensors");
  const std::optional<Key> key = layout_of(op, q, k, v, cu_q, cu_k, max_q, max_k, scale);
  TORCH_CHECK(key.has_value(), "remember_attention: q, k, v are 3-D and the offsets 1-D");
  TORCH_CHECK(driver().launch != nullptr && driver().memset != nullptr,
              "remember_attention: cuLaunchKernel or cuMemsetD8Async not found in libcuda.so.1");
  auto launch = std::make_shared<Launch>();
  launch->function = reinterpret_cast<CUfunction>(static_cast<uintptr_t>(function));
  for (int d = 0; d < 3; ++d) launch->grid[d] = static_cast<unsigned>(grid[d]);
  launch->block = static_cast<unsigned>(block);
  launch->shared_bytes = static_cast<unsigned>(shared_bytes);
  launch->params.assign(kinds.size(), 0);
  for (size_t i = 0; i < kinds.size(); ++i) {
    const int64_t value = values[i];
    uint64_t& word = launch->params[i];
    switch (kinds[i]) {
      case kPointer:
        TORCH_CHECK(value >= 0 && value < kTensorCodes, "remember_attention: unknown tensor code ", value);
        launch->addresses.emplace_back(i, value);
        if (value == kCounter) launch->counted = true;
        break;
      case kI32:
      case kU32:
      case kF32Bits:
        word = static_cast<uint32_t>(value);
        break;
      case kI64:
      case kU64:
        word = static_cast<uint64_t>(value);
        break;
      case kI8:
        word = static_cast<uint8_t>(value);
        break;
      case kI16:
        word = static_cast<uint16_t>(value);
        break;
      default:
        TORCH_CHECK(false, "remember_attention: unknown parameter kind ", kinds[i]);
    }
  }
  TORCH_CHECK(scratch_bytes >= 0, "remember_attention: scratch_bytes is not negative, got ", scratch_bytes);
  launch->scratch_bytes = scratch_bytes;
  launch->head_dim_v = v.size(2);
  launch->device = q.device().index();
  if (config.has_value()) launch->config = std::string(config->data(), config->size());
  {
    const std::lock_guard<std::mutex> lock(table_mutex);
    if (table.size() >= kMaxLayouts) table.clear();
    table[*key] = std::move(launch);
    table_empty.store(false, std::memory_order_relaxed);
  }
  register_kernels();
}

void forget_attention() {
  {
    const std::lock_guard<std::mutex> lock(table_mutex);
    table.clear();
    table_empty.store(true, std::memory_order_relaxed);
  }
  unregister_kernels();
}

int64_t remembered_attention_layouts() {
  const std::lock_guard<std::mutex> lock(table_mutex);
  return static_cast<int64_t>(table.size());
}

bool kernels_registered() {
  const std::lock_guard<std::mutex> lock(registration_mutex);
  return kernels != nullptr;
}

}  // namespace
}  // namespace mla_native

TORCH_LIBRARY_FRAGMENT(mla_native, m) {
  m.def(
      "remember_attention(int op, Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor cu_seqlens_k, "
      "int max_seqlen_q, int max_seqlen_k, float softmax_scale, int function, int[] grid, int block, "
      "int shared_bytes, int[] kinds, int[] values, str? config, int scratch_bytes=0) -> ()",
      &mla_native::remember_attention);
  m.def("forget_attention() -> ()", &mla_native::forget_attention);
  m.def("remembered_attention_layouts() -> int", &mla_native::remembered_attention_layouts);
  m.def("attention_kernels_registered() -> bool", &mla_native::kernels_registered);
}

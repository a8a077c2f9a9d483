// Triton's hand-out of a warp-specialised kernel's partitions, in CUDA C++, for compute-sanitizer's racecheck.
//
// Triton (3.6 to 3.9, sm_90a) starts the partitions of a kernel such as mla_ops' Gluon attention kernel like this:
// twelve warps; the default partition (warps 0-3) stores one state byte per worker warp (which partition it runs),
// then `barrier.sync 1` (every thread) releases the workers, which load their byte and run partition 0 (warps 4-7)
// or idle; both sides meet at `barrier.sync 1` again, the default stores "exit" (4), and a last `barrier.sync 1`
// lets the workers load it and leave. Every store is ordered before the loads that read it by a barrier that all
// 384 threads execute. This program copies that protocol (and the register hand-over Triton emits, with flag 8);
// racecheck's verdict on it separates a report about the tool from one about the kernel
// (docs/design/triton-kernels.md, Under compute-sanitizer).
//
// Build and run (flags: a number, the sum of those below):
//   nvcc -gencode arch=compute_90a,code=sm_90a -lineinfo -o /tmp/racecheck_handout benchmarks/racecheck_handout.cu
//   for f in 0 1 2 3 5 35 19; do
//     compute-sanitizer --tool racecheck --racecheck-report all --print-limit 0 /tmp/racecheck_handout $f | tail -1
//   done
//
//   1   the default partition sums a value over its four warps through shared scratch, ordered by `bar.sync 0, 128`
//       (as Triton synchronises a partition's own warps: 4 of the 12 warps, id 0 for the default partition)
//   2   partition 0 does the same with `bar.sync 2, 128`
//   4   the default partition's barrier takes id 3 instead of 0
//   8   setmaxnreg as Triton emits it around the partitions
//   16  the sums without their barriers: warps 1-3 store late, so the sums come out wrong (racecheck must object)
//   32  the sums' barriers without .aligned (`barrier.sync ID, 128`)
//
// Each run prints how many sums came out wrong: 0 wherever the barriers are in place. A hazard racecheck reports
// on the state bytes (the stores at the "exit" line, the loads in the workers' loop) with 0 sums wrong is about
// the tool's view of the order, not about the program's.
#include <cstdio>
#include <cstdlib>

__device__ __forceinline__ void all_threads_barrier() { asm volatile("barrier.sync 1;" ::: "memory"); }

__device__ int warp_sum(int v) {
  for (int o = 16; o; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

template <int ID>
__device__ __forceinline__ void partition_barrier(bool aligned) {
  if (aligned) asm volatile("bar.sync %0, 128;" ::"n"(ID) : "memory");  // barrier.sync.aligned, as Triton emits
  else asm volatile("barrier.sync %0, 128;" ::"n"(ID) : "memory");
}

// The sum over a partition's four warps of `value`, as Triton lowers gl.sum over four warps: lane 0 of each warp
// stores its warp's sum, barrier, threads 0-3 load them and thread 0 stores the total, barrier, every thread loads it.
template <int ID>
__device__ int partition_sum(int* scratch, int local_tid, int value, bool ordered, bool aligned) {
  int s = warp_sum(value);
  if (local_tid / 32 != 0) __nanosleep(100000);  // warps 1-3 store late: an unordered load sees stale scratch
  if (local_tid % 32 == 0) scratch[local_tid / 32] = s;
  if (ordered) partition_barrier<ID>(aligned);
  int t = local_tid < 4 ? scratch[local_tid] : 0;
  t += __shfl_xor_sync(0xffffffffu, t, 2);
  t += __shfl_xor_sync(0xffffffffu, t, 1);
  if (local_tid == 0) scratch[0] = t;
  if (ordered) partition_barrier<ID>(aligned);
  return scratch[0];
}

__global__ void __maxnreg__(168) handout(int flags, int* out) {
  __shared__ __align__(16) int scratch_default[4];
  __shared__ __align__(16) unsigned char state[8];
  __shared__ __align__(16) int scratch_p0[4];
  int warp = threadIdx.x / 32;
  bool ordered = !(flags & 16), aligned = !(flags & 32);
  if (warp < 4) {  // the default partition
    if (flags & 8) asm volatile("setmaxnreg.inc.sync.aligned.u32 256;");
    if (threadIdx.x < 4) scratch_default[threadIdx.x] = scratch_p0[threadIdx.x] = 0;
    reinterpret_cast<uint2*>(state)[0] = make_uint2(0u, 0x03010102u);  // every default thread, as Triton's store
    all_threads_barrier();
    if (flags & 8) asm volatile("setmaxnreg.dec.sync.aligned.u32 232;");
    all_threads_barrier();
    int total = 0;
    if (flags & 1) {
      total = flags & 4 ? partition_sum<3>(scratch_default, threadIdx.x, threadIdx.x + 1, ordered, aligned)
                        : partition_sum<0>(scratch_default, threadIdx.x, threadIdx.x + 1, ordered, aligned);
    }
    if (threadIdx.x == 0) out[blockIdx.x * 2] = total;
    all_threads_barrier();
    if (flags & 8) asm volatile("setmaxnreg.inc.sync.aligned.u32 256;");
    reinterpret_cast<uint2*>(state)[0] = make_uint2(0x04040404u, 0x04040404u);  // "exit" for every worker warp
    all_threads_barrier();
  } else {  // the worker warps' loop
    for (;;) {
      if (flags & 8) asm volatile("setmaxnreg.dec.sync.aligned.u32 120;");
      all_threads_barrier();
      int s = state[warp - 4];
      if (s == 4) return;
      if (s == 0) {  // partition 0, warps 4-7
        if (flags & 8) asm volatile("setmaxnreg.inc.sync.aligned.u32 232;");
        all_threads_barrier();
        int total = 0;
        if (flags & 2) total = partition_sum<2>(scratch_p0, threadIdx.x - 128, threadIdx.x - 127, ordered, aligned);
        if (threadIdx.x == 128) out[blockIdx.x * 2 + 1] = total;
        all_threads_barrier();
        if (flags & 8) asm volatile("setmaxnreg.dec.sync.aligned.u32 120;");
      } else {  // a one-warp partition that does nothing here, and the warps that pad the block to 12
        if (flags & 8) asm volatile("setmaxnreg.dec.sync.aligned.u32 40;");
        all_threads_barrier();
        all_threads_barrier();
        if (flags & 8) asm volatile("setmaxnreg.inc.sync.aligned.u32 120;");
      }
    }
  }
}

int main(int argc, char** argv) {
  if (argc > 1 && argv[1][0] == '-') {
    std::printf("usage: %s [FLAGS]  (the header of racecheck_handout.cu lists the flags)\n", argv[0]);
    return 0;
  }
  const int flags = argc > 1 ? std::atoi(argv[1]) : 0, blocks = 8;
  int* out;
  cudaMalloc(&out, 2 * blocks * sizeof(int));
  cudaMemset(out, 0, 2 * blocks * sizeof(int));
  handout<<<blocks, 384>>>(flags, out);
  int host[2 * blocks];
  cudaMemcpy(host, out, sizeof(host), cudaMemcpyDeviceToHost);
  const int want = 128 * 129 / 2;
  int wrong = 0;
  for (int b = 0; b < blocks; ++b) {
    wrong += ((flags & 1) && host[2 * b] != want) + ((flags & 2) && host[2 * b + 1] != want);
  }
  cudaError_t error = cudaGetLastError();
  std::printf("flags %d: %s, %d of %d sums wrong\n", flags, cudaGetErrorString(error), wrong, 2 * blocks);
  return error == cudaSuccess ? 0 : 1;
}

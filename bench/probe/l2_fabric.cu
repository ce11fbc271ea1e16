// Does an access to a line homed in the SM's own L2 partition (by the latency of a returning
// atomic, as bench/probe/l2_sides.cu finds it) stay off the L2 fabric? Session 29 measured the
// paired o_pool and paired K/V (which assume so) slower, with the fabric's sectors unchanged:
// half of the sum pass's reduction sectors still came from the fabric. This probe separates
// the assumption from our kernels.
//
// `label`: one CTA per SM; lane 0 times a returning atom.add on each of NC 4 KiB chunks (after
// a warm-up pass) and marks the chunk near (below the midpoint of its fastest and slowest) for
// its %smid. `work` (same grid, one CTA per SM, each looking its labels up by %smid): every
// thread touches 16 bytes of each chunk of the chosen class, REP times, by
//   mode 0/1: red.global.add.f32 into near/far chunks,
//   mode 2/3: one 4 KiB cp.reduce.async.bulk add.f32 (the TMA reduction path) per chunk,
//   mode 4/5: ld.global.cg reads.
// Run each launch under ncu with the fabric metrics (bench/results/s29/call3/call.sh).
//
// Build and run on the GPU machine: nvcc -O2 -gencode=arch=compute_90a,code=sm_90a
//   bench/probe/l2_fabric.cu -o /tmp/l2_fabric && /tmp/l2_fabric
#include <cstdio>
#include <cstdlib>
#include <cuda_runtime.h>
#include "atom_latency.cuh"

#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { \
  fprintf(stderr, "%s: %s\n", #x, cudaGetErrorString(e)); exit(1); } } while (0)

constexpr int NC = 2048;        // chunks of 4 KiB: 8 MiB, inside L2
constexpr int MAX_SM = 256;
constexpr int REP = 2;

__global__ void label(unsigned *buf, unsigned char *near, int *count) {
  extern __shared__ __align__(4) unsigned char pad[];
  if (threadIdx.x != 0) return;
  pad[0] = 0;
  unsigned smid;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(smid));
  unsigned short lat[NC];
  unsigned dep = 0;
  for (int pass = 0; pass < 2; pass++) {
    for (int k = 0; k < NC; k++) {
      int c = (k + blockIdx.x * 61) % NC;
      unsigned *p = buf + (size_t)c * 1024 + (blockIdx.x % 64) + dep;
      lat[c] = timed_atom(p, dep, reinterpret_cast<unsigned *>(pad));
    }
  }
  unsigned lo = 65535, hi = 0;
  for (int c = 0; c < NC; c++) { lo = min(lo, (unsigned)lat[c]); hi = max(hi, (unsigned)lat[c]); }
  unsigned mid = (lo + hi) / 2;
  int n = 0;
  for (int c = 0; c < NC; c++) {
    unsigned char is_near = lat[c] < mid;
    near[smid * NC + c] = is_near;
    n += is_near;
  }
  count[smid] = n;
}

__global__ void work(float *buf, const unsigned char *near, int mode, float *sink) {
  extern __shared__ __align__(128) unsigned char smem[];
  unsigned smid;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(smid));
  const unsigned char *mine = near + smid * NC;
  unsigned char want = (mode % 2 == 0);  // even modes: near chunks
  int kind = mode / 2;
  float *ones = reinterpret_cast<float *>(smem);
  for (int i = threadIdx.x; i < 1024; i += blockDim.x) ones[i] = 1.0f;
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  __syncthreads();
  unsigned s_ones = (unsigned)__cvta_generic_to_shared(ones);
  float acc = 0.f;
  for (int r = 0; r < REP; r++) {
    for (int k = 0; k < NC; k++) {
      int c = (k + blockIdx.x * 61) % NC;
      if (mine[c] != want) continue;
      float *chunk = buf + (size_t)c * 1024;
      if (kind == 0) {
        for (int j = 0; j < 4; j++) {
          float *p = chunk + j * 256 + threadIdx.x;
          asm volatile("red.global.add.f32 [%0], %1;" :: "l"(p), "f"(1.0f) : "memory");
        }
      } else if (kind == 1) {
        if (threadIdx.x == 0) {
          asm volatile(
              "cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], 4096;"
              :: "l"(chunk), "r"(s_ones) : "memory");
          asm volatile("cp.async.bulk.commit_group;" ::: "memory");
        }
      } else {
        float4 v;
        const float4 *p = reinterpret_cast<const float4 *>(chunk) + threadIdx.x;
        asm volatile("ld.global.cg.v4.f32 {%0,%1,%2,%3}, [%4];"
                     : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "l"(p));
        acc += v.x + v.y + v.z + v.w;
      }
    }
  }
  if (kind == 1 && threadIdx.x == 0) asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
  if (acc == -1.0f) sink[0] = acc;
}

int main() {
  int sms = 0, smem_max = 0;
  CK(cudaSetDevice(0));
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  CK(cudaDeviceGetAttribute(&smem_max, cudaDevAttrMaxSharedMemoryPerBlockOptin, 0));
  int smem = smem_max * 2 / 3;  // no two CTAs fit on one SM
  CK(cudaFuncSetAttribute(label, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  CK(cudaFuncSetAttribute(work, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  float *buf, *sink;
  unsigned char *near;
  int *count;
  CK(cudaMalloc(&buf, (size_t)NC * 4096));
  CK(cudaMemset(buf, 0, (size_t)NC * 4096));
  CK(cudaMalloc(&near, (size_t)MAX_SM * NC));
  CK(cudaMemset(near, 2, (size_t)MAX_SM * NC));  // 2: no label (no SM matches it)
  CK(cudaMalloc(&count, MAX_SM * sizeof(int)));
  CK(cudaMemset(count, 0, MAX_SM * sizeof(int)));
  CK(cudaMalloc(&sink, 4));
  label<<<sms, 32, smem>>>(reinterpret_cast<unsigned *>(buf), near, count);
  CK(cudaDeviceSynchronize());
  int h[MAX_SM];
  CK(cudaMemcpy(h, count, sizeof h, cudaMemcpyDeviceToHost));
  int labelled = 0, lo = NC, hi = 0;
  for (int s = 0; s < MAX_SM; s++) {
    if (!h[s]) continue;
    labelled++;
    lo = h[s] < lo ? h[s] : lo;
    hi = h[s] > hi ? h[s] : hi;
  }
  printf("SMs %d, labelled %d, near chunks per SM %d..%d of %d\n", sms, labelled, lo, hi, NC);
  const char *names[] = {"red near", "red far", "bulk red near", "bulk red far",
                         "read near", "read far"};
  for (int mode = 0; mode < 6; mode++) {
    cudaEvent_t a, b;
    CK(cudaEventCreate(&a));
    CK(cudaEventCreate(&b));
    CK(cudaEventRecord(a));
    work<<<sms, 256, smem>>>(buf, near, mode, sink);
    CK(cudaEventRecord(b));
    CK(cudaEventSynchronize(b));
    float ms = 0;
    CK(cudaEventElapsedTime(&ms, a, b));
    printf("mode %d (%s): %.3f ms\n", mode, names[mode], ms);
  }
  CK(cudaGetLastError());
  return 0;
}

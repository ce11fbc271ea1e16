// Which L2 partition each SM sits next to, and which partition each address is homed in, from
// the latency of returning atomics (an atomic is performed at the line's home partition, so it
// crosses the L2 fabric exactly when the home is not the SM's own side).
//
// One CTA per SM (a shared-memory request no two CTAs fit beside), lane 0 timing one
// `atom.global.add` per probed address, each CTA starting at a different address so that no
// two hit one line together. Prints the latency histogram, each SM's agreement with CTA 0's
// fast/slow pattern (about 1 on CTA 0's side, 0 on the other), and the homes' run lengths along
// the address at several strides.
//
// Build and run on the GPU machine: nvcc -O2 -gencode=arch=compute_90a,code=sm_90a
//   bench/probe/l2_sides.cu -o /tmp/l2_sides && /tmp/l2_sides
#include <cstdio>
#include <cstdlib>
#include <vector>
#include <algorithm>
#include <cuda_runtime.h>
#include "atom_latency.cuh"

#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { \
  fprintf(stderr, "%s: %s\n", #x, cudaGetErrorString(e)); exit(1); } } while (0)

__global__ void probe(unsigned *buf, unsigned long long step_words, int n,
                      unsigned short *lat, int *smid_out) {
  extern __shared__ __align__(4) unsigned char pad[];
  if (threadIdx.x != 0) return;
  unsigned smid;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(smid));
  smid_out[blockIdx.x] = smid;
  pad[0] = 0;
  unsigned dep = 0;
  for (int k = 0; k < n; k++) {
    int j = (k + blockIdx.x * 61) % n;
    unsigned *p = buf + (unsigned long long)j * step_words + dep;
    lat[(size_t)blockIdx.x * n + j] = timed_atom(p, dep, reinterpret_cast<unsigned *>(pad));
  }
}

int main() {
  int dev = 0, sms = 0;
  CK(cudaSetDevice(dev));
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  int smem_max = 0;
  CK(cudaDeviceGetAttribute(&smem_max, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev));
  int smem = smem_max * 2 / 3;  // no two CTAs fit on one SM
  CK(cudaFuncSetAttribute(probe, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  const size_t bytes = 256ull << 20;
  unsigned *buf;
  CK(cudaMalloc(&buf, bytes));
  CK(cudaMemset(buf, 0, bytes));
  printf("SMs %d, buffer %p\n", sms, (void *)buf);
  struct Cfg { unsigned long long step; int n; };
  Cfg cfgs[] = {{32, 4096}, {256, 8192}, {4096, 8192}, {65536, 512}};
  std::vector<int> ref_side;  // the first config's SM sides, by CTA
  for (const Cfg &c : cfgs) {
    int n = c.n;
    unsigned short *dl; int *ds;
    CK(cudaMalloc(&dl, (size_t)sms * n * 2));
    CK(cudaMalloc(&ds, sms * 4));
    probe<<<sms, 32, smem>>>(buf, c.step / 4, n, dl, ds);  // warm-up: lines into L2
    CK(cudaDeviceSynchronize());
    probe<<<sms, 32, smem>>>(buf, c.step / 4, n, dl, ds);
    CK(cudaDeviceSynchronize());
    std::vector<unsigned short> l((size_t)sms * n);
    std::vector<int> sm(sms);
    CK(cudaMemcpy(l.data(), dl, l.size() * 2, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(sm.data(), ds, sms * 4, cudaMemcpyDeviceToHost));
    if (const char *out = getenv("OUT")) {  // raw latencies [CTA][address] u16, then smids i32
      char path[512];
      snprintf(path, sizeof path, "%s/lat_%llu.bin", out, c.step);
      if (FILE *f = fopen(path, "wb")) {
        fwrite(l.data(), 2, l.size(), f);
        fwrite(sm.data(), 4, sm.size(), f);
        fclose(f);
      }
    }
    std::vector<unsigned short> all(l);
    std::sort(all.begin(), all.end());
    size_t m = all.size();
    printf("\n== stride %llu B, %d addresses (%llu KiB)\n", c.step, n, c.step * n / 1024);
    printf("latency percentiles (cycles): p1 %u p10 %u p25 %u p50 %u p75 %u p90 %u p99 %u\n",
           all[m / 100], all[m / 10], all[m / 4], all[m / 2], all[3 * m / 4], all[9 * m / 10],
           all[99 * m / 100]);
    // Histogram in 20-cycle bins between p1 and p99.
    unsigned lo = all[m / 100], hi = all[99 * m / 100];
    std::vector<size_t> h((hi - lo) / 20 + 1);
    for (auto v : all) if (v >= lo && v <= hi) h[(v - lo) / 20]++;
    for (size_t b = 0; b < h.size(); b++)
      if (h[b] * 200 > m) printf("  %5u-%5u: %zu\n", lo + 20 * (unsigned)b, lo + 20 * (unsigned)b + 19, h[b]);
    // Threshold: the largest gap between populated bins' means is crude; use the midpoint of
    // p10 and p90, which separates the two modes when each holds at least a tenth.
    unsigned thr = (all[m / 10] + all[9 * m / 10]) / 2;
    printf("threshold %u\n", thr);
    auto fast = [&](int cta, int j) { return l[(size_t)cta * n + j] < thr; };
    std::vector<int> side(sms);
    int same = 0, other = 0, unclear = 0;
    for (int b = 0; b < sms; b++) {
      int agree = 0;
      for (int j = 0; j < n; j++) agree += fast(b, j) == fast(0, j);
      double f = (double)agree / n;
      side[b] = f > 0.9 ? 0 : (f < 0.1 ? 1 : -1);
      if (side[b] == 0) same++; else if (side[b] == 1) other++; else unclear++;
      if (side[b] < 0) printf("  cta %d smid %d agreement %.3f\n", b, sm[b], f);
    }
    printf("SMs on CTA 0's side %d, other side %d, unclear %d\n", same, other, unclear);
    if (ref_side.empty()) ref_side = side;
    int diff = 0;
    for (int b = 0; b < sms; b++) diff += side[b] != ref_side[b];
    printf("sides differing from the first stride's: %d\n", diff);
    // The smid -> side map (side 0 = CTA 0's), sorted by smid.
    std::vector<int> map(1024, -2);
    for (int b = 0; b < sms; b++) map[sm[b]] = side[b];
    printf("side by smid:");
    for (int s = 0; s < 1024; s++) if (map[s] != -2) printf("%s%d", s % 16 ? "" : " ", map[s] < 0 ? 9 : map[s]);
    printf("\n");
    // Homes along the address: home = 0 where CTA 0's side is fast, by majority over the CTAs
    // of both sides (a CTA of side 1 is fast where home is 1).
    std::vector<int> home(n);
    int h0 = 0;
    for (int j = 0; j < n; j++) {
      int v0 = 0, v1 = 0;
      for (int b = 0; b < sms; b++) {
        if (side[b] < 0) continue;
        bool f = fast(b, j);
        if ((side[b] == 0) == f) v0++; else v1++;
      }
      home[j] = v0 >= v1 ? 0 : 1;
      h0 += home[j] == 0;
    }
    printf("addresses homed on side 0: %d of %d\n", h0, n);
    printf("first 256 homes:\n");
    for (int j = 0; j < std::min(n, 256); j++) printf("%d%s", home[j], (j + 1) % 64 ? "" : "\n");
    std::vector<int> runs;
    int r = 1;
    for (int j = 1; j < n; j++) { if (home[j] == home[j - 1]) r++; else { runs.push_back(r); r = 1; } }
    runs.push_back(r);
    std::sort(runs.begin(), runs.end());
    printf("runs of one home: %zu, min %d median %d max %d (in addresses of %llu B)\n", runs.size(),
           runs.front(), runs[runs.size() / 2], runs.back(), c.step);
    CK(cudaFree(dl));
    CK(cudaFree(ds));
  }
  return 0;
}

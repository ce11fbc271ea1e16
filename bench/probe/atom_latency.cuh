// The timed returning atomic both L2 probes use (l2_sides.cu, l2_fabric.cu).
#pragma once

// Cycles of one returning `atom.global.add.u32 1` at `p`, at most 65535. `dep` (always 0)
// becomes the next address's offset: in-order issue makes the shift wait for the atomic's
// return, the clock read for the shift, and the next address for the shift's result.
__device__ inline unsigned short timed_atom(unsigned *p, unsigned &dep) {
  long long t0 = clock64();
  unsigned old, use;
  asm volatile("atom.global.add.u32 %0, [%1], 1;" : "=r"(old) : "l"(p) : "memory");
  asm volatile("shr.u32 %0, %1, 31;" : "=r"(use) : "r"(old));
  long long t1 = clock64();
  dep = use;
  long long d = t1 - t0;
  return (unsigned short)(d > 65535 ? 65535 : d);
}

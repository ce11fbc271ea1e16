// The timed returning atomic both L2 probes use (l2_sides.cu, l2_fabric.cu).
#pragma once

// Cycles of one returning `atom.global.add.u32 1` at `p`, at most 65535. The second clock
// read must issue after the atomic returns: in-order issue holds it back behind an instruction
// that waits for the atomic's value, but ptxas may schedule an arithmetic consumer after the
// read (it did in l2_fabric.cu's `label`, which then timed the issue gap). A volatile store of
// the value to `sink` (shared memory, this thread's only) is a memory operation it keeps
// ahead of the read, as the kernels' `l2_sides::latency` does. `dep` (always 0) becomes the
// next address's offset, so that the next atomic waits for this one as well.
__device__ inline unsigned short timed_atom(unsigned *p, unsigned &dep, unsigned *sink) {
  long long t0 = clock64();
  unsigned old;
  asm volatile("atom.global.add.u32 %0, [%1], 1;" : "=r"(old) : "l"(p) : "memory");
  *reinterpret_cast<volatile unsigned *>(sink) = old;
  long long t1 = clock64();
  dep = old >> 31;
  long long d = t1 - t0;
  return (unsigned short)(d > 65535 ? 65535 : d);
}

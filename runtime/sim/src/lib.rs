//! A functional (not cycle-accurate) simulator of the PTX subset the MSA codegen emits.
//!
//! It reads PTX **text** — the files under `generated/` that the runtime JIT-loads — decodes
//! each instruction once into [`ir::Op`], and runs a grid CTA by CTA, each CTA's warps of 32
//! lanes in lockstep with per-lane PCs (see [`exec`] for the scheduling model). Global memory
//! is a set of 256-byte-aligned allocations in a 64-bit space; shared memory (static and
//! dynamic) is per CTA; kernel arguments go through a parameter buffer laid out like the
//! driver's. Every out-of-bounds or misaligned access, division by zero, unconverged
//! `shfl.sync`, misused barrier and deadlock is an error naming the kernel, PC, source line,
//! CTA and thread (or, for a deadlock, every warp's PC and the barrier it waits on).
//!
//! To run the MSA backward on your own tensors, see [`backward::upload_inputs`] and
//! [`backward::download_gradients`]. Build the simulator optimised: a dependent crate must set
//! `[profile.dev.package.msa-sim] opt-level = 3` (and the same for `msa-runtime`) in its own
//! root `Cargo.toml`, because Cargo ignores a dependency's profile settings; unoptimised it is
//! about 14 times slower (the repository README has the figures).
//!
//! ```
//! use msa_sim::{Arg, Gpu, LaunchConfig, Module};
//!
//! let ptx = r#"
//! .version 8.0
//! .target sm_90a
//! .address_size 64
//! .visible .entry add_one(.param .u64 .ptr .align 16 buf)
//! {
//!     .reg .u32 %r<3>;
//!     .reg .u64 %rd<4>;
//!     ld.param.u64 %rd0, [buf];
//!     cvta.to.global.u64 %rd1, %rd0;
//!     mov.u32 %r0, %tid.x;
//!     mul.wide.u32 %rd2, %r0, 4;
//!     add.u64 %rd3, %rd1, %rd2;
//!     ld.global.u32 %r1, [%rd3];
//!     add.u32 %r2, %r1, 1;
//!     st.global.u32 [%rd3], %r2;
//!     ret;
//! }
//! "#;
//! let module = Module::parse(ptx).unwrap();
//! let mut gpu = Gpu::new();
//! let buf = gpu.upload("buf", &[10u32, 20, 30, 40]);
//! let cfg = LaunchConfig::new((1, 1, 1), (4, 1, 1));
//! gpu.launch(module.kernel("add_one").unwrap(), &cfg, &[Arg::Ptr(buf)]).unwrap();
//! assert_eq!(gpu.read::<u32>(buf, 4).unwrap(), [11, 21, 31, 41]);
//! ```
//!
//! With the default `runtime` feature, [`device::SimDevice`] implements `msa_runtime::Backend`,
//! so the runtime's own host flow (`MsaBackward::run_on`, the task build, preprocess and
//! postprocess) runs on the simulator exactly as on a GPU; [`backward`] builds problems and
//! checks the gradients.
//!
//! # Numerics
//!
//! Integer, bit, f32 `add`/`sub`/`mul`/`fma` (round to nearest even, single rounding for
//! `fma`), conversions and bf16 packing are bit-exact per the PTX ISA; f32 arithmetic results
//! that are NaN are the canonical `0x7fffffff`. Deviation: `ex2.approx.f32` is computed as
//! `exp2` in f64 rounded to f32 (the hardware approximation is within 2 ulp of that), with
//! `.ftz` flushing subnormal inputs and results; likewise `lg2.approx.f32` as `log2` in f64
//! rounded to f32. `rcp.rn.f32` is exact (the correctly rounded `1/x`).
//!
//! `wgmma` follows the sm_90 tensor core bit for bit ([`tensor_core`]: one fused block of
//! the sixteen exact products and the accumulator, aligned to the largest exponent, cut 25
//! bits below it, summed and rounded toward zero), fitted to and checked against an H200.
//! `tcgen05.mma` computes in f32 from exact products accumulated sequentially in k within each
//! instruction; the B200's order and precision have not been measured.
//!
//! # Scope
//!
//! Every instruction of the generated Hopper and Blackwell kernels, the main kernels'
//! asynchronous machinery included: `mbarrier.{init,arrive[.expect_tx],expect_tx,complete_tx,
//! try_wait.parity,test_wait.parity}`, `cp.async.bulk.tensor` (tile loads through a
//! [`SimTensorMap`], the simulator's stand-in for a `CUtensorMap`), `cp.reduce.async.bulk.tensor
//! ... .add.tile.bulk_group` (a bf16 box added at issue; its shared source must be fenced and
//! stays guarded against generic stores until `cp.async.bulk.wait_group.read` retires its
//! `cp.async.bulk.commit_group`, and a CTA that ends before then is a fault), `stmatrix.m8n8`, `bar.warp.sync`, `wgmma.{fence,
//! mma_async,commit_group,wait_group}` (m64nNk16, bf16/f16 → f32, SS and RS, 128B-swizzled
//! descriptors), `setmaxnreg`, `fence.proxy.async`, `fence.mbarrier_init`, `elect.sync`,
//! `trap`, and the Blackwell `tcgen05` family with `cta_group::1`: tensor memory (`alloc`,
//! `dealloc`, `relinquish_alloc_permit`), `mma.kind::f16` (M = 128, SS and TS forms, SM100
//! descriptors), `commit` to an mbarrier, `ld`/`st` `.32x32b.xN`, `wait::{ld,st}` and the
//! thread-sync fences (see [`exec`]). [`Module::parse`] rejects anything else with
//! ``unsupported instruction `...` at line N``; [`coverage`] lists what a text uses and what is
//! not modelled.

#![warn(missing_docs)]

#[cfg(feature = "runtime")]
pub mod backward;
pub mod coverage;
mod decode;
#[cfg(feature = "runtime")]
pub mod device;
pub mod error;
pub mod exec;
pub mod ir;
pub mod launch;
pub mod memory;
pub mod module;
pub mod numeric;
mod parse;
mod smem_layout;
pub mod tensor_core;
pub mod tensor_map;

pub use error::{FaultKind, Location, MemoryFault, MemoryFaultKind, ParseError, SimError, Stall};
pub use exec::{
    CtaOrder, Gpu, L2Sides, L2Traffic, LaunchStats, Limits, Tcgen05Numerics, TmaCompletion,
    UmmaOrder,
};
pub use launch::{Arg, LaunchConfig};
pub use memory::{DevPtr, Element};
pub use module::{Kernel, Module, Param};
pub use tensor_map::SimTensorMap;

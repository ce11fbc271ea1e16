//! Host runtime of the MSA (MiniMax Sparse Attention) backward kernels: it JIT-loads the PTX
//! in `generated/` through the CUDA driver and runs the whole backward on one stream, with no
//! host sync.
//!
//! # From host data to gradients
//!
//! 1. **Describe the documents and the selection.** `cu_seqlens [docs+1]` packs the
//!    documents; `q2k [4, T, 16]` holds each query's selected document-local key blocks
//!    (`docs/design.md` §1.3; [`causal_support`] makes the causal one). Ask
//!    [`check_capacity`] first if the shape may be large: it answers before anything is
//!    allocated.
//! 2. **Build the schedule** with [`build_schedule`] (or validate the forward's arrays with
//!    [`Schedule::new`]). Every error names the field, the value and the expectation.
//! 3. **Upload** `q`, `grad_out`, `out` `[T, 64, 128]` bf16, `lse [T, 64]` fp32 and compact
//!    `k`, `v` `[T, 4, 128]` bf16, then pack K and V into the aligned layout with
//!    [`to_aligned`]. It zero-fills the padding rows, which the backward requires
//!    (see [`BackwardBuffers`]).
//! 4. **Run** [`run_backward`] (or [`MsaBackward::run`] to own the cached workspace). It
//!    returns `dq [T, 64, 128]` and the aligned `dk_aligned`, `dv_aligned [W, 4, 128]`.
//! 5. **Unpack** dK and dV to compact rows with [`from_aligned`], and download.
//!
//! The host side runs anywhere:
//!
//! ```
//! use msa_runtime::{build_schedule, causal_support, check_capacity};
//!
//! // Two documents of 130 and 5 tokens: T = 135, aligned W = 256 + 128 = 384 rows.
//! let cu_seqlens = [0, 130, 135];
//! check_capacity(&cu_seqlens)?;
//! let q2k = causal_support(&cu_seqlens)?;
//! let schedule = build_schedule(&q2k, &cu_seqlens, 64)?;
//! assert_eq!((schedule.num_tokens(), schedule.workspace_rows()), (135, 384));
//!
//! // More tokens than one call takes: refused before anything is allocated, with the
//! // real bound in the message.
//! let err = check_capacity(&[0, 1 << 19, (1 << 20) + 1]).unwrap_err();
//! assert!(err.to_string().contains("tokens T = 1048577"), "{err}");
//! # Ok::<(), msa_runtime::ScheduleError>(())
//! ```
//!
//! On a GPU (compute capability 9.0 or 10.0):
//!
//! ```no_run
//! use half::bf16;
//! use msa_runtime::{build_schedule, causal_support, from_aligned, run_backward, to_aligned};
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let cu_seqlens = [0, 130, 135];
//! let schedule = build_schedule(&causal_support(&cu_seqlens)?, &cu_seqlens, 64)?;
//! let t = schedule.num_tokens();
//! // Your tensors, row-major; zeros stand in for them here.
//! let (q, grad_out, out) = (vec![bf16::ZERO; t * 64 * 128], vec![bf16::ZERO; t * 64 * 128],
//!     vec![bf16::ZERO; t * 64 * 128]);
//! let (k, v) = (vec![bf16::ZERO; t * 4 * 128], vec![bf16::ZERO; t * 4 * 128]);
//! let lse = vec![0.0f32; t * 64];
//!
//! let stream = msa_runtime::Device::open(0)?.context().default_stream();
//! let (q, grad_out, out) =
//!     (stream.clone_htod(&q)?, stream.clone_htod(&grad_out)?, stream.clone_htod(&out)?);
//! let (k, v, lse) = (stream.clone_htod(&k)?, stream.clone_htod(&v)?, stream.clone_htod(&lse)?);
//! // Compact K/V into the zero-padded aligned layout, on the device.
//! let (k_aligned, v_aligned) = to_aligned(&stream, &schedule, &k.as_view(), &v.as_view())?;
//! let g = run_backward(
//!     &stream,
//!     &q.as_view(),
//!     &k_aligned.as_view(),
//!     &v_aligned.as_view(),
//!     &grad_out.as_view(),
//!     &lse.as_view(),
//!     &out.as_view(),
//!     &schedule,
//! )?;
//! let (dk, dv) = from_aligned(&stream, &schedule, &g.dk_aligned.as_view(), &g.dv_aligned.as_view())?;
//! let (dq, dk, dv) = (stream.clone_dtoh(&g.dq)?, stream.clone_dtoh(&dk)?, stream.clone_dtoh(&dv)?);
//! assert_eq!((dq.len(), dk.len(), dv.len()), (t * 64 * 128, t * 512, t * 512));
//! # Ok(()) }
//! ```
//!
//! Without a GPU, the `msa-sim` crate runs the same host flow on a simulator of the generated
//! PTX: `msa_sim::backward::upload_inputs` takes your host tensors (compact K/V) and
//! `msa_sim::backward::download_gradients` returns compact dQ/dK/dV, around
//! `MsaBackward::<msa_sim::device::SimDevice>::run_on`. Build it optimised (the README says
//! which profile settings a dependent crate needs).
//!
//! # What the backward checks
//!
//! Before anything is issued: every buffer's length against the schedule's `T` and `W`, every
//! base non-null and 16-byte aligned, and no output overlapping another output or an input
//! ([`RuntimeError::NullBuffer`], [`RuntimeError::Overlap`]; exact in-place use is an
//! explicit choice, [`MsaBackward::allow_in_place`]); the architecture, the kernels' JIT and
//! the tensor maps. An error therefore never leaves the outputs half-written. The one thing a
//! host check cannot see is the contents of device memory: that is why the runtime writes the
//! aligned padding itself ([`to_aligned`]).
//!
//! # From another framework
//!
//! - **Same cudarc** (candle 0.11, anything on cudarc 0.19): depend on `msa-runtime` with
//!   `default-features = false` so that your graph picks cudarc's linking mode and CUDA
//!   version, and pass your `Arc<CudaStream>` and `CudaView`s to [`run_backward`] directly;
//!   [`cudarc`] is re-exported to name the same types.
//! - **Another cudarc or a private stream type** (burn/cubecl, PyTorch through a C ABI, a CUDA
//!   C++ extension): [`run_backward_raw`] takes the raw `CUstream` and a [`BackwardBuffers`]
//!   of raw device addresses ([`CudaBackend::from_raw_stream`] with [`MsaBackward::run_on`]
//!   to own the workspace). Nothing is synchronized; the work runs on that stream, in its
//!   order.
//!
//! # Concurrency
//!
//! A workspace never leaves the stream that allocated it: [`run_backward`] keeps one per
//! stream, and an [`MsaBackward`] called on another stream moves to it (see "One stream at a
//! time" there). Any number of threads may call on any number of streams;
//! `tests/tests/concurrency.rs` checks two threads on two streams with different shapes
//! against single-stream runs on an H200 (it passes on this code; it did not provoke the
//! failure of the code before it either, see the README). [`release_workspace`] frees a stream's cached
//! workspace.
//!
//! # Layers
//!
//! Bottom up; no module imports from a layer above its own (`scripts/runtime-layers.py`,
//! run by the test command, checks it, and `scripts/import-cycles.py runtime/src` finds no
//! circle):
//!
//! 1. **Contract and schedule**, pure data and rules: [`contract`], [`schedule`], [`error`],
//!    and the f32 CPU reference [`mod@reference`].
//! 2. **The [`Backend`] trait and its value types** ([`Span`], [`Ptr`], [`KernelSpec`],
//!    [`backend::TileMapSpec`], [`tma::TensorMap`]): [`backend`], and the host checks of the
//!    buffers a call is given.
//! 3. **The host flow, generic over [`Backend`]**: the launches ([`ops`], [`tasks`],
//!    [`aligned`]), the device schedule build ([`schedule_build`]) and the whole backward
//!    ([`backward`]: [`MsaBackward::run_on`]), the forward ([`forward`]: [`MsaForward::run_on`])
//!    and the experimental KV-parallel forward ([`forward_kv`]).
//! 4. **The CUDA backend** on cudarc: [`cuda`] ([`CudaBackend`], the tensor-map encoding),
//!    [`device`] (JIT loading, memoized device facts) and [`timed`] ([`TimedBackend`], events
//!    around every operation for a cost breakdown).
//! 5. **The cudarc convenience API**: the entry points on `Arc<CudaStream>` and `CudaView`s
//!    ([`run_backward`], [`MsaBackward::run`], [`to_aligned`], [`run_forward`], [`run_preprocess`], ...) and
//!    [`run_backward_raw`]. Each lives in a `stream` child of the flow module it wraps, which
//!    re-exports it so that its path (`msa_runtime::backward::run_backward`) stays.
//!
//! The `msa-sim` crate's `SimDevice` is a second backend beside the CUDA one (layer 4), run by
//! the same flow. The one name a lower layer takes from a higher one is the default type
//! parameter of `MsaBackward<B = CudaBackend>`. The design notes the documentation cites as
//! "`docs/design.md` §N" are in the repository's `docs/design.md`.

#![warn(missing_docs)]

pub mod aligned;
pub mod backend;
pub mod backward;
mod buffers;
pub mod contract;
pub mod cp;
pub mod cuda;
pub mod device;
pub mod error;
pub mod forward;
pub mod forward_kv;
pub mod ops;
pub mod reference;
pub mod schedule;
pub mod schedule_build;
pub mod tasks;
pub mod timed;
mod views;

/// Launch bindings generated by `cargo run -p codegen` from the kernel descriptions.
#[allow(missing_docs)]
pub mod kernels {
    include!(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../generated/bindings.rs"
    ));
}

/// CUtensorMap parameters (TMA descriptors), passed to kernels by value.
pub mod tma {
    use cudarc::driver::DeviceRepr;

    /// The 128 bytes of a CUtensorMap (encoded by `cuTensorMapEncodeTiled`, or by a simulator
    /// in its own format), 64-byte aligned like the driver's type.
    #[repr(C, align(64))]
    #[derive(Clone, Copy, PartialEq, Eq)]
    pub struct TensorMap(pub [u8; 128]);

    // SAFETY: plain data the kernel reads as a by-value `.b8 [128]` parameter.
    unsafe impl DeviceRepr for TensorMap {}

    impl From<cudarc::driver::sys::CUtensorMap> for TensorMap {
        /// The bytes of a descriptor the driver encoded.
        fn from(map: cudarc::driver::sys::CUtensorMap) -> TensorMap {
            // SAFETY: CUtensorMap is 128 bytes of plain data (no padding, any bit pattern).
            TensorMap(unsafe {
                std::mem::transmute::<cudarc::driver::sys::CUtensorMap, [u8; 128]>(map)
            })
        }
    }
}

/// The cudarc this crate is built against (0.19), so that a dependent crate can name the
/// same `CudaStream`, `CudaSlice` and driver types (`msa_runtime::cudarc::driver::...`)
/// or match its own version requirement to it.
pub use cudarc;

pub use aligned::{from_aligned, from_aligned_on, to_aligned, to_aligned_on};
pub use backend::{Backend, KernelArg, KernelSpec, Ptr, PtrMut, Span};
pub use backward::{
    release_workspace, release_workspace_raw, run_backward, run_backward_deterministic,
    run_backward_raw, BackwardBuffers, BackwardSchedule, Gradients, MsaBackward,
};
pub use contract::*;
pub use cp::{
    Collective, CpBackward, CpBuffers, CpForward, CpForwardBuffers, CpLayout, CpSchedule,
    HostGroup, RankSchedule,
};
pub use cuda::CudaBackend;
pub use device::{driver_present, Device};
pub use error::RuntimeError;
pub use forward::{run_forward, ForwardBuffers, ForwardOutput, MsaAttention, MsaForward, Saved};
pub use forward_kv::{ForwardAlgorithm, KV_FORWARD_MIN_MEAN_DOC};
pub use ops::{run_postprocess, run_preprocess};
pub use schedule::ScheduleError;
pub use schedule::{
    build_schedule, build_schedule_for_rows, causal_support, check_capacity, check_shape_capacity,
    workspace_layout, Schedule, SelectionFault, WorkItem, METADATA_COLUMNS,
};
pub use schedule_build::{
    max_workspace_rows, ResidentSchedule, ScheduleBuildSizes, MAX_BUILD_TOKENS,
};
pub use timed::TimedBackend;

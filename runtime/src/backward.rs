//! The MSA backward host flow (`docs/design.md` §1.5, §3.1): validation, TMA descriptors, the cached
//! gradient workspace and the launch sequence
//! `preprocess → zero pools → task build → main kernel → postprocess`, stream-ordered and
//! without a host sync.
//!
//! The flow is written once against [`Backend`]: [`MsaBackward::run_on`] drives the CUDA
//! driver ([`CudaBackend`]) or the `msa-sim` simulator through the same workspace carving,
//! tensor-map parameters, launch geometry and kernel order. [`MsaBackward`] owns the workspace
//! of one stream and reuses it across calls; the free function [`run_backward`] keeps one per
//! stream.
//!
//! Layer 3 of the crate (the host flow, generic over [`Backend`]); its cudarc entry points
//! ([`run_backward`], [`MsaBackward::run`], [`run_backward_raw`]) are layer 5, in the `stream`
//! child, re-exported here.

use crate::backend::{Backend, KernelSpec, Span};
pub use crate::backend::{MapElem, TileMapSpec};
use crate::buffers::{check_regions, Region};
use crate::contract::{Locality, BLOCK_SIZE, KV_ROW, MAX_TOKENS, NUM_Q_HEADS, Q_ROW};
use crate::cuda::CudaBackend;
use crate::error::RuntimeError;
use crate::kernels::{
    bwd_postprocess, bwd_postprocess_det, bwd_preprocess, bwd_preprocess_det, msa_backward_sm100,
    msa_backward_sm100_det, msa_backward_sm90, msa_backward_sm90_det, task_assign_segments,
    task_scan_bins, task_scan_work, task_scatter_tables,
};
use crate::ops::{
    check_len, postprocess, postprocess_deterministic, preprocess, preprocess_deterministic,
    FixedPointPools, BOUND_WORDS,
};
use crate::schedule::Schedule;
use crate::schedule_build::ResidentSchedule;
use crate::tasks::{DeviceSchedule, ScheduleRefs, ScheduleShape, TaskBuildSizes, TaskWorkspace};
use half::bf16;
use std::mem::size_of;

mod stream;
pub use stream::{
    release_workspace, release_workspace_raw, run_backward, run_backward_deterministic,
    run_backward_raw, Gradients,
};

/// Workspace regions start on 256-byte boundaries (`docs/design.md` §3.1).
const REGION_ALIGN: usize = 256;

// ---------------------------------------------------------------------------------------------
// The gradient workspace

/// Byte offsets of the regions of the gradient workspace (`docs/design.md` §3.1), each rounded up to
/// 256 bytes: the fp32 dK then dV pools `[W, 4, 128]`, delta fp32 `[T, 64]` and, only when
/// asked for, a bf16 dQ pool of `T · 64 · 128` elements.
///
/// The main kernels normally reduce dQ straight into the caller's `dq` buffer (the Hopper
/// kernel in its own layout, the Blackwell kernel head-pair-interleaved, which
/// `bwd_postprocess` de-interleaves in place; `docs/design.md` §3.6), so the workspace holds
/// no dQ pool. A separate pool is needed only when `dq` lies on an input the main kernel still
/// reads (in-place use on `q` or `grad_out`, [`MsaBackward::allow_in_place`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PoolLayout {
    /// Tokens `T` the regions are sized for.
    pub num_tokens: usize,
    /// Workspace rows `W` the regions are sized for.
    pub workspace_rows: usize,
    /// Offset of the dK pool.
    pub dk_pool: usize,
    /// Offset of the dV pool.
    pub dv_pool: usize,
    /// Offset of delta.
    pub delta: usize,
    /// Offset of the separate dQ pool, when the layout has one.
    pub dq_pool: Option<usize>,
    /// Offset of `row_bounds [T, 4]` u32 (the deterministic layout only, see
    /// [`PoolLayout::is_deterministic`]).
    pub row_bounds: Option<usize>,
    /// Offset of `bounds [32]` u32 (deterministic layout only).
    pub bounds: Option<usize>,
    /// Total bytes (a multiple of 256).
    pub bytes: usize,
}

impl PoolLayout {
    /// Lays out the regions for `num_tokens` tokens and `workspace_rows` rows, with a separate
    /// dQ pool when `with_dq_pool`.
    ///
    /// # Errors
    /// [`RuntimeError::Input`] if the byte count overflows `usize`.
    pub fn new(
        num_tokens: usize,
        workspace_rows: usize,
        with_dq_pool: bool,
    ) -> Result<Self, RuntimeError> {
        Self::lay_out(num_tokens, workspace_rows, with_dq_pool, false)
    }

    /// Whether this is the deterministic mode's layout ([`PoolLayout::deterministic`]): its
    /// dK/dV pools hold one signed 64-bit word per element, its dQ pool (always a separate
    /// one) integer-valued f32, and it has the two bound buffers.
    pub fn is_deterministic(&self) -> bool {
        self.bounds.is_some()
    }

    /// The deterministic mode's layout ([`MsaBackward::set_deterministic`]): dK and dV pools
    /// of `W·512` signed 64-bit words, delta, a dQ pool of `T·8192` integer-valued f32
    /// (`T · 32 KiB`, twice the default's and never the caller's `dq`), `row_bounds [T, 4]` and
    /// `bounds`.
    ///
    /// # Errors
    /// [`RuntimeError::Input`] if the byte count overflows `usize`.
    pub fn deterministic(num_tokens: usize, workspace_rows: usize) -> Result<Self, RuntimeError> {
        Self::lay_out(num_tokens, workspace_rows, true, true)
    }

    fn lay_out(
        num_tokens: usize,
        workspace_rows: usize,
        with_dq_pool: bool,
        fixed_point: bool,
    ) -> Result<Self, RuntimeError> {
        // Bytes per dQ element and per dK/dV element of the pools.
        let (dq_elem, kv_elem) = if fixed_point {
            (4, 8)
        } else {
            (size_of::<bf16>(), size_of::<f32>())
        };
        let overflow = || {
            RuntimeError::input(
                "schedule",
                format!("T = {num_tokens}, W = {workspace_rows}"),
                "a gradient workspace whose byte size fits in usize",
            )
        };
        let dq_bytes = num_tokens
            .checked_mul(Q_ROW * dq_elem)
            .ok_or_else(overflow)?;
        let kv_bytes = workspace_rows
            .checked_mul(KV_ROW * kv_elem)
            .ok_or_else(overflow)?;
        let delta_bytes = num_tokens
            .checked_mul(NUM_Q_HEADS * size_of::<f32>())
            .ok_or_else(overflow)?;
        let mut at = 0usize;
        let mut take = |bytes: usize| -> Result<usize, RuntimeError> {
            let start = at;
            at = at
                .checked_add(bytes)
                .and_then(|end| end.checked_next_multiple_of(REGION_ALIGN))
                .ok_or_else(overflow)?;
            Ok(start)
        };
        let dk_pool = take(kv_bytes)?;
        let dv_pool = take(kv_bytes)?;
        let delta = take(delta_bytes)?;
        let dq_pool = if with_dq_pool {
            Some(take(dq_bytes)?)
        } else {
            None
        };
        let (row_bounds, bounds) = if fixed_point {
            let rows = num_tokens.checked_mul(16).ok_or_else(overflow)?;
            (Some(take(rows)?), Some(take(4 * BOUND_WORDS)?))
        } else {
            (None, None)
        };
        Ok(PoolLayout {
            num_tokens,
            workspace_rows,
            dk_pool,
            dv_pool,
            delta,
            dq_pool,
            row_bounds,
            bounds,
            bytes: at,
        })
    }
}

/// The one allocation of the gradient pools and delta, carved by a [`PoolLayout`].
struct GradientPools<B: Backend> {
    layout: PoolLayout,
    base: u64,
    // Never read: it owns the memory `base` points into.
    #[allow(dead_code)]
    storage: B::Buffer,
}

impl<B: Backend> GradientPools<B> {
    fn new(backend: &mut B, layout: PoolLayout) -> Result<Self, RuntimeError> {
        // Left uninitialised on purpose: every call zeroes the pools it uses, and the
        // preprocess writes every delta element it uses before anything reads them.
        let storage = backend.alloc("gradient workspace", layout.bytes)?;
        Ok(GradientPools {
            layout,
            base: backend.address(&storage),
            storage,
        })
    }

    fn fits(&self, num_tokens: usize, workspace_rows: usize, dq_pool: bool, fixed: bool) -> bool {
        num_tokens <= self.layout.num_tokens
            && workspace_rows <= self.layout.workspace_rows
            && (!dq_pool || self.layout.dq_pool.is_some())
            && self.layout.is_deterministic() == fixed
    }

    /// The deterministic layout's fixed-point buffers for `(t, w)`.
    fn fixed_point(&self, t: usize, w: usize) -> Option<FixedPointPools> {
        let l = &self.layout;
        let (dq, rows, bounds) = (l.dq_pool?, l.row_bounds?, l.bounds?);
        Some(FixedPointPools {
            dq: self.span(dq, t * Q_ROW),
            dk: self.span(l.dk_pool, 2 * w * KV_ROW),
            dv: self.span(l.dv_pool, 2 * w * KV_ROW),
            row_bounds: self.span(rows, 4 * t),
            bounds: self.span(bounds, BOUND_WORDS),
        })
    }

    fn span<T>(&self, offset: usize, len: usize) -> Span<T> {
        Span::new(self.base + offset as u64, len)
    }
}

// ---------------------------------------------------------------------------------------------
// The backward

/// The device buffers of one backward call: the inputs of `docs/design.md` §1.5 and the outputs
/// the call writes.
///
/// Checked by [`MsaBackward::run_on`] before anything is issued: each length against the
/// schedule's `T` and `W`; each base non-null and 16-byte aligned; no output overlapping
/// another output or an input, unless [`MsaBackward::allow_in_place`] allows an output exactly
/// on an input of the same size. Inputs may share memory with each other.
///
/// # The padding contract
///
/// `k_aligned` and `v_aligned` are in the schedule's aligned layout, and **their padding rows
/// must be zero**: every row of `[W, 4, 128]` that holds no token (the tail of each document's
/// 128-aligned region, and any gap between regions). The main kernels load padding rows as
/// part of each 128-key block; the causal mask removes their probabilities, but a NaN or Inf
/// there still reaches dQ through `0·NaN` in the `dS·K` product, so a buffer made with
/// `torch.empty` or left uninitialised gives NaN gradients. The runtime cannot see device
/// contents from the host, so instead it owns the layout: make these two buffers with
/// [`crate::to_aligned`] (or [`crate::to_aligned_on`]), which writes every row, padding
/// included, from compact `[T, 4, 128]` K/V. The outputs `dk_aligned` and `dv_aligned` are
/// written whole, padding rows as zeros; [`crate::from_aligned`] brings them back to compact.
#[derive(Debug, Clone, Copy)]
pub struct BackwardBuffers {
    /// `q [T, 64, 128]` bf16.
    pub q: Span<bf16>,
    /// `k_aligned [W, 4, 128]` bf16, padding rows zero (see above).
    pub k_aligned: Span<bf16>,
    /// `v_aligned [W, 4, 128]` bf16, padding rows zero (see above).
    pub v_aligned: Span<bf16>,
    /// `grad_out [T, 64, 128]` bf16.
    pub grad_out: Span<bf16>,
    /// `lse [T, 64]` fp32.
    pub lse: Span<f32>,
    /// `out [T, 64, 128]` bf16.
    pub out: Span<bf16>,
    /// Output `dq [T, 64, 128]` bf16.
    pub dq: Span<bf16>,
    /// Output `dk_aligned [W, 4, 128]` bf16 (padding rows zero).
    pub dk_aligned: Span<bf16>,
    /// Output `dv_aligned [W, 4, 128]` bf16 (padding rows zero).
    pub dv_aligned: Span<bf16>,
}

/// The MSA backward of one device with its cached workspace, on any [`Backend`] (the CUDA
/// driver by default, or the `msa-sim` simulator).
///
/// Holds the gradient workspace (one allocation: dK/dV pools, delta, and a dQ pool only for
/// in-place use of `dq` on `q` or `grad_out`; see [`PoolLayout`]) and the task-build
/// workspace. The gradient workspace grows to the largest `(T, W)` seen and never shrinks; the
/// task workspace is reused while its sizes fit.
///
/// # One stream at a time
///
/// The workspaces belong to the stream ([`Backend::queue`]) of the memory space that
/// allocated them: a call on another stream, or another CUDA context or simulated device,
/// drops them (each is freed stream-ordered on its own stream, behind every kernel that used
/// it) and allocates new ones there. So two streams never share a workspace, and a workspace
/// is never freed or regrown under a kernel still running on another stream; but alternating
/// streams reallocates on every call. Keep one `MsaBackward` per stream, as [`run_backward`]
/// does. (A [`ResidentSchedule`] is the caller's: build and use it on one stream.)
pub struct MsaBackward<B: Backend = CudaBackend> {
    // (memory space, queue) the workspaces belong to.
    owner: Option<(u64, u64)>,
    pools: Option<GradientPools<B>>,
    tasks: Option<TaskWorkspace<B>>,
    // The last call's schedule upload, kept until the next call so its buffers are freed
    // stream-ordered after the kernels that read them, never by a synchronizing free here.
    schedule: Option<DeviceSchedule<B>>,
    allocations: usize,
    in_place: bool,
    locality: Locality,
    deterministic: bool,
}

impl<B: Backend> Default for MsaBackward<B> {
    fn default() -> Self {
        MsaBackward {
            owner: None,
            pools: None,
            tasks: None,
            schedule: None,
            allocations: 0,
            in_place: false,
            locality: Locality::default(),
            deterministic: false,
        }
    }
}

impl<B: Backend> std::fmt::Debug for MsaBackward<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MsaBackward")
            .field("capacity", &self.capacity())
            .field("allocations", &self.allocations)
            .finish()
    }
}

/// The schedule a backward runs on: a validated host [`Schedule`] (uploaded by the call), or a
/// [`ResidentSchedule`] the device built (read in place: nothing is copied).
pub enum BackwardSchedule<'a, B: Backend> {
    /// A host schedule; `run_on` copies it to the device, stream-ordered.
    Host(&'a Schedule),
    /// A schedule built on the device; a flagged one has no work (zero gradients).
    Device(&'a ResidentSchedule<B>),
}

// By hand: a derive would ask `B: Clone`, which the references do not need.
impl<B: Backend> Clone for BackwardSchedule<'_, B> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<B: Backend> Copy for BackwardSchedule<'_, B> {}

impl<'a, B: Backend> From<&'a Schedule> for BackwardSchedule<'a, B> {
    fn from(s: &'a Schedule) -> Self {
        BackwardSchedule::Host(s)
    }
}

impl<'a, B: Backend> From<&'a ResidentSchedule<B>> for BackwardSchedule<'a, B> {
    fn from(s: &'a ResidentSchedule<B>) -> Self {
        BackwardSchedule::Device(s)
    }
}

impl<B: Backend> BackwardSchedule<'_, B> {
    /// Tokens of the query-side buffers: the schedule's query rows (all of `T` unless it is a
    /// context-parallel rank's).
    fn query_row_count(&self) -> usize {
        match self {
            BackwardSchedule::Host(s) => s.query_rows().len(),
            BackwardSchedule::Device(s) => s.query_rows().len(),
        }
    }

    /// The shape the task build is sized from, and `W`.
    fn shape(&self) -> (ScheduleShape, usize) {
        match self {
            BackwardSchedule::Host(s) => (
                ScheduleShape {
                    num_tokens: s.num_tokens(),
                    num_docs: s.num_documents(),
                    edge_capacity: s.edge_capacity(),
                    work_capacity: s.work_capacity(),
                },
                s.workspace_rows(),
            ),
            BackwardSchedule::Device(s) => {
                let z = s.sizes();
                (
                    ScheduleShape {
                        num_tokens: z.num_tokens,
                        num_docs: z.num_documents,
                        edge_capacity: z.edge_capacity,
                        work_capacity: z.work_capacity,
                    },
                    z.workspace_rows,
                )
            }
        }
    }
}

/// The kernels of every backward besides the main one, in the default or the deterministic
/// mode.
fn backward_kernels(deterministic: bool) -> [&'static KernelSpec; 6] {
    let (pre, post) = if deterministic {
        (&bwd_preprocess_det::KERNEL, &bwd_postprocess_det::KERNEL)
    } else {
        (&bwd_preprocess::KERNEL, &bwd_postprocess::KERNEL)
    };
    [
        pre,
        post,
        &task_scan_work::KERNEL,
        &task_assign_segments::KERNEL,
        &task_scan_bins::KERNEL,
        &task_scatter_tables::KERNEL,
    ]
}

/// Where a default-mode main kernel reduces dQ (the deterministic kernels use fixed-point
/// pools of their own).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum DqLayout {
    /// `[T, 64, 128]`, the output's own layout (`msa_backward_sm90`).
    Compact,
    /// Head-pair-interleaved `[T, 32, 128, 2]` (`msa_backward_sm100`), de-interleaved by
    /// `bwd_postprocess`.
    HeadPairs,
}

/// The dQ layout `main` writes.
fn dq_layout(main: &KernelSpec) -> DqLayout {
    if main.name == msa_backward_sm90::KERNEL.name {
        DqLayout::Compact
    } else {
        DqLayout::HeadPairs
    }
}

/// The capabilities the main kernel has a variant for, for error messages.
const SUPPORTED: &str = "9.0 (msa_backward_sm90), 10.0 (msa_backward_sm100)";

/// The main kernel for capability `cc`; both variants take the same parameters.
///
/// # Errors
/// [`RuntimeError::UnsupportedArch`] on any capability but 9.0 and 10.0.
pub fn main_kernel(cc: (i32, i32), ordinal: usize) -> Result<&'static KernelSpec, RuntimeError> {
    main_kernel_for(cc, ordinal, false)
}

/// [`main_kernel`], or its deterministic variant (`msa_backward_sm90_det`,
/// `msa_backward_sm100_det`), which takes the fixed-point pools and the bounds.
///
/// # Errors
/// [`RuntimeError::UnsupportedArch`] on any capability but 9.0 and 10.0.
pub fn main_kernel_for(
    cc: (i32, i32),
    ordinal: usize,
    deterministic: bool,
) -> Result<&'static KernelSpec, RuntimeError> {
    match (cc, deterministic) {
        ((9, 0), false) => Ok(&msa_backward_sm90::KERNEL),
        ((10, 0), false) => Ok(&msa_backward_sm100::KERNEL),
        ((9, 0), true) => Ok(&msa_backward_sm90_det::KERNEL),
        ((10, 0), true) => Ok(&msa_backward_sm100_det::KERNEL),
        ((major, minor), _) => Err(RuntimeError::UnsupportedArch {
            kernel: "msa_backward",
            ordinal,
            major,
            minor,
            supported: SUPPORTED.into(),
        }),
    }
}

/// The host checks on the addresses of `io` (its lengths are already checked); see
/// [`check_regions`]. With `in_place`, an output may lie exactly on an input of the same
/// size: `dk_aligned`/`dv_aligned` are written only by `bwd_postprocess`, after the main
/// kernel's last read of every input; `dq` is zeroed after the preprocess (the only reader
/// of `out`) and accumulates during the main kernel, so on `q`, `grad_out` or any other input
/// the main kernel reads it gets a separate pool instead ([`dq_needs_pool`]).
fn check_buffers(io: &BackwardBuffers, in_place: bool) -> Result<(), RuntimeError> {
    check_regions(
        &[
            Region::input("q", io.q)?,
            Region::input("k_aligned", io.k_aligned)?,
            Region::input("v_aligned", io.v_aligned)?,
            Region::input("grad_out", io.grad_out)?,
            Region::input("lse", io.lse)?,
            Region::input("out", io.out)?,
            Region::output("dq", io.dq)?,
            Region::output("dk_aligned", io.dk_aligned)?,
            Region::output("dv_aligned", io.dv_aligned)?,
        ],
        in_place,
        "MsaBackward::allow_in_place(true)",
    )
}

/// Whether `dq` lies on an input the main kernel reads (possible only in place), so that the
/// main kernel must reduce into a separate workspace pool rather than into `dq` itself.
/// `out` is not among them: only the preprocess reads it, before `dq` is zeroed.
fn dq_needs_pool(io: &BackwardBuffers) -> Result<bool, RuntimeError> {
    let dq = Region::output("dq", io.dq)?;
    Ok([
        Region::input("q", io.q)?,
        Region::input("grad_out", io.grad_out)?,
        Region::input("k_aligned", io.k_aligned)?,
        Region::input("v_aligned", io.v_aligned)?,
        Region::input("lse", io.lse)?,
    ]
    .iter()
    .any(|r| r.overlaps(&dq)))
}

impl<B: Backend> MsaBackward<B> {
    /// An empty cache; nothing is allocated until the first call.
    pub fn new() -> Self {
        Self::default()
    }

    /// Whether an output may lie exactly on an input of the same size (`dq` on `q`, `grad_out`
    /// or `out`; `dk_aligned`/`dv_aligned` on `k_aligned` or `v_aligned`); off by default, so
    /// that any overlap is a [`RuntimeError::Overlap`].
    ///
    /// In-place use is safe for the gradients: `dk_aligned`/`dv_aligned` are written only by
    /// `bwd_postprocess`, after the main kernel's last read of every input, and `dq`, which
    /// the main kernel normally accumulates into directly, then gets a separate workspace pool
    /// (`T · 16 KiB`) when it lies on `q` or `grad_out` (on `out` it needs none: only the
    /// preprocess reads `out`, before `dq` is zeroed). The input's contents are of course gone
    /// after the call. Outputs overlapping each other, and partial overlaps, are rejected
    /// either way.
    pub fn allow_in_place(&mut self, allow: bool) -> &mut Self {
        self.in_place = allow;
        self
    }

    /// The deterministic mode (off by default; `docs/design.md` §3.8): dQ, dK and dV are
    /// accumulated as fixed-point integers, so the gradients are the same bits on every call,
    /// stream and process for the same inputs on the same device, whatever the grid, the SM
    /// count or the order the reductions land in. It needs a larger workspace
    /// ([`PoolLayout::deterministic`]: `T · 32 KiB` for dQ and `W · 4 KiB` for dK/dV, against
    /// `W · 2 KiB` and usually no dQ pool) and launches `bwd_preprocess_det`,
    /// `msa_backward_sm90_det`/`msa_backward_sm100_det` and `bwd_postprocess_det` instead of the
    /// default kernels. The results agree with the default mode's within the same tolerances;
    /// they are not bitwise equal to them. Switching the mode reallocates the workspace on the
    /// next call.
    pub fn set_deterministic(&mut self, on: bool) -> &mut Self {
        self.deterministic = on;
        self
    }

    /// Whether the deterministic mode is on.
    pub fn deterministic(&self) -> bool {
        self.deterministic
    }

    /// The locality rule of the task order (default [`Locality::default`]); checked by the
    /// next call, which rejects an out-of-range rule with [`RuntimeError::Input`]. The
    /// gradients do not depend on it, only the speed does.
    pub fn set_locality(&mut self, locality: Locality) {
        self.locality = locality;
    }

    /// The locality rule the next call uses.
    pub fn locality(&self) -> Locality {
        self.locality
    }

    /// Device allocations the cache has made so far (gradient and task workspaces). A repeated
    /// call with the same schedule shape makes none.
    pub fn allocation_count(&self) -> usize {
        self.allocations
    }

    /// The task-build workspace of the last call, if any (its tables stay valid until the
    /// next call).
    pub fn task_workspace(&self) -> Option<&TaskWorkspace<B>> {
        self.tasks.as_ref()
    }

    /// Device bytes the cache holds now: the gradient workspace (its [`PoolLayout`]), the
    /// task-build workspace and the last call's schedule upload (none for a resident
    /// schedule, which its owner holds). The caller's inputs and outputs are not included.
    pub fn workspace_bytes(&self) -> usize {
        self.pools.as_ref().map_or(0, |p| p.layout.bytes)
            + self.tasks.as_ref().map_or(0, |t| t.storage().1)
            + self.schedule.as_ref().map_or(0, DeviceSchedule::bytes)
    }

    /// The gradient workspace's layout, if allocated.
    pub fn pool_layout(&self) -> Option<PoolLayout> {
        self.pools.as_ref().map(|p| p.layout)
    }

    /// `(T, W)` the gradient workspace is sized for, if allocated.
    pub fn capacity(&self) -> Option<(usize, usize)> {
        self.pools
            .as_ref()
            .map(|p| (p.layout.num_tokens, p.layout.workspace_rows))
    }

    /// Allocates the workspaces and loads every kernel a backward on `schedule` needs, so that
    /// a following [`MsaBackward::run_on`] of that shape (the schedule's build included)
    /// allocates nothing and loads nothing: the step before capturing them in a CUDA graph.
    /// With [`MsaBackward::allow_in_place`] on, that includes the separate dQ pool an in-place
    /// `dq` on `q` or `grad_out` needs.
    ///
    /// # Errors
    /// Those of [`MsaBackward::run_on`]'s preparation (architecture, sizes, allocation, JIT).
    pub fn reserve(
        &mut self,
        backend: &mut B,
        schedule: &ResidentSchedule<B>,
    ) -> Result<(), RuntimeError> {
        self.adopt(backend);
        let main = main_kernel_for(backend.capability(), backend.ordinal(), self.deterministic)?;
        for k in backward_kernels(self.deterministic)
            .iter()
            .copied()
            .chain([main])
            .chain(ResidentSchedule::<B>::kernels())
        {
            backend.load(k)?;
        }
        let (shape, w) = BackwardSchedule::Device(schedule).shape();
        let (t, work) = (shape.num_tokens, shape.work_capacity);
        let sizes = TaskBuildSizes::for_shape(shape, backend.sm_count(), self.locality)?;
        let dq_pool = self.in_place;
        ensure_pools(
            &mut self.pools,
            &mut self.allocations,
            backend,
            (t, w),
            dq_pool,
            self.deterministic,
        )?;
        ensure_tasks(&mut self.tasks, &mut self.allocations, backend, sizes, work)?;
        Ok(())
    }

    /// Drops the cache when `backend` is another memory space or queue than the cached one
    /// (see "One stream at a time" above).
    fn adopt(&mut self, backend: &B) {
        let owner = (backend.memory_space(), backend.queue());
        if self.owner != Some(owner) {
            let (allocations, locality, in_place, deterministic) = (
                self.allocations,
                self.locality,
                self.in_place,
                self.deterministic,
            );
            *self = MsaBackward {
                owner: Some(owner),
                allocations,
                in_place,
                locality,
                deterministic,
                ..MsaBackward::default()
            };
        }
    }

    /// Runs the backward on `backend`, writing `io.dq`, `io.dk_aligned` and `io.dv_aligned`.
    ///
    /// Inputs (`docs/design.md` §1.5): `q`, `grad_out`, `out` `[T, 64, 128]` bf16, `k_aligned`,
    /// `v_aligned` `[W, 4, 128]` bf16 in the aligned workspace layout with zero padding rows
    /// (made by [`crate::to_aligned`]; see [`BackwardBuffers`]), `lse [T, 64]` fp32, with
    /// `T = schedule.num_tokens()` and `W = schedule.workspace_rows()`; every base 16-byte
    /// aligned.
    ///
    /// `schedule` is a host [`Schedule`] or a device-built [`ResidentSchedule`] (anything
    /// that converts into a [`BackwardSchedule`]); for the latter `T` and `W` are its sizes,
    /// nothing is copied from the host, and after [`MsaBackward::reserve`] nothing is
    /// allocated either (the call can be captured in a CUDA graph). A flagged resident
    /// schedule has no work items: the call writes zero gradients.
    ///
    /// Issues, in order (`docs/design.md` §3.1): `bwd_preprocess`, the zeroing of `dq` (the
    /// main kernels' dQ pool) and the dK/dV pools,
    /// the schedule copy (host schedules only), the four task-build kernels, the main kernel
    /// for the capability
    /// (`msa_backward_sm90` on 9.0, `msa_backward_sm100` on 10.0) on
    /// `grid_launch_bound(capacity, sm_count)` CTAs, and `bwd_postprocess`; no host sync.
    /// All checks, kernel loading, tensor maps and workspace allocation come before the first
    /// write, so an error never leaves the outputs half-written.
    ///
    /// # Errors
    /// - [`RuntimeError::Input`] naming the field for a wrong length, a misaligned base, or a
    ///   workspace too large to address.
    /// - [`RuntimeError::NullBuffer`] naming a null base, and [`RuntimeError::Overlap`] naming
    ///   two buffers that overlap against the rule of [`BackwardBuffers`].
    /// - [`RuntimeError::UnsupportedArch`] on any capability but 9.0 and 10.0.
    /// - [`RuntimeError::TensorMap`]/[`RuntimeError::TensorMapEncode`],
    ///   [`RuntimeError::Jit`], [`RuntimeError::Alloc`],
    ///   [`RuntimeError::Launch`], [`RuntimeError::Driver`] and [`RuntimeError::Simulator`]
    ///   from the backend.
    pub fn run_on<'s>(
        &mut self,
        backend: &mut B,
        io: &BackwardBuffers,
        schedule: impl Into<BackwardSchedule<'s, B>>,
    ) -> Result<(), RuntimeError>
    where
        B: 's,
    {
        self.run_inner(backend, io, schedule.into(), KvOut::Aligned, None)
            .map(|_| ())
    }

    /// [`MsaBackward::run_on`] up to the dK/dV postprocess (`crate::cp`): the query side as
    /// usual (dQ into `io.dq`, `rows()` of [`Schedule::query_rows`]); dK/dV are left in the
    /// fp32 pools, which are sized and zeroed for `kv_rows >= W` rows and returned as
    /// `(dk_pool, dv_pool)` spans of `[kv_rows, 4, 128]` f32 (rows past `W` stay zero).
    /// `io.dk_aligned`/`io.dv_aligned` are only checked against the other buffers for overlap:
    /// the caller writes them with [`crate::ops::postprocess`] once the pools are final.
    /// `before_main` runs right before the main kernel is issued, after the preprocess, the
    /// zeroing and the task build (the context-parallel flow waits for its K/V gather there).
    pub(crate) fn run_to_pools(
        &mut self,
        backend: &mut B,
        io: &BackwardBuffers,
        schedule: BackwardSchedule<'_, B>,
        kv_rows: usize,
        before_main: BeforeMain<'_, B>,
    ) -> Result<KvPools, RuntimeError> {
        let pools = self.run_inner(
            backend,
            io,
            schedule,
            KvOut::Pools { rows: kv_rows },
            Some(before_main),
        )?;
        pools.ok_or_else(|| RuntimeError::input("kv_rows", kv_rows, "pools to return"))
    }

    /// Step 1 of [`MsaBackward::run_inner`], pure host checks: the shapes, lengths, alignment
    /// and overlaps of the call, before anything is allocated or issued.
    fn check_call(
        &self,
        backend: &B,
        io: &BackwardBuffers,
        schedule: &BackwardSchedule<'_, B>,
        kv_out: KvOut,
    ) -> Result<CallSizes, RuntimeError> {
        let (shape, w) = schedule.shape();
        let t = shape.num_tokens;
        // The query-side buffers hold the schedule's query rows (all of T unless restricted).
        let tq = schedule.query_row_count();
        let pool_rows = match kv_out {
            KvOut::Aligned => w,
            KvOut::Pools { .. } if self.deterministic => {
                return Err(RuntimeError::input(
                    "deterministic",
                    "true",
                    "the default mode for a context-parallel rank (its fp32 pools are reduced across ranks)",
                ))
            }
            KvOut::Pools { rows } if rows >= w && rows.is_multiple_of(BLOCK_SIZE) => rows,
            KvOut::Pools { rows } => {
                return Err(RuntimeError::input(
                    "kv_rows",
                    rows,
                    format!("a multiple of 128 of at least W = {w}"),
                ))
            }
        };

        if t > MAX_TOKENS {
            return Err(RuntimeError::input(
                "schedule.cu_seqlens",
                format!("T = {t} tokens"),
                format!(
                    "at most MAX_TOKENS = {MAX_TOKENS} (the dQ pool's 32-bit word index); \
                     split the call"
                ),
            ));
        }
        let q_len = tq.checked_mul(Q_ROW);
        let kv_len = w.checked_mul(KV_ROW);
        let (Some(q_len), Some(kv_len)) = (q_len, kv_len) else {
            return Err(RuntimeError::input(
                "schedule",
                format!("T = {t}, W = {w}"),
                "element counts that fit in usize",
            ));
        };
        check_len("q", io.q.len, q_len, "[T, 64, 128] bf16")?;
        check_len("k_aligned", io.k_aligned.len, kv_len, "[W, 4, 128] bf16")?;
        check_len("v_aligned", io.v_aligned.len, kv_len, "[W, 4, 128] bf16")?;
        check_len("grad_out", io.grad_out.len, q_len, "[T, 64, 128] bf16")?;
        check_len("lse", io.lse.len, tq * NUM_Q_HEADS, "[T, 64] f32")?;
        check_len("out", io.out.len, q_len, "[T, 64, 128] bf16")?;
        check_len("dq", io.dq.len, q_len, "[T, 64, 128] bf16")?;
        if let KvOut::Aligned = kv_out {
            check_len("dk_aligned", io.dk_aligned.len, kv_len, "[W, 4, 128] bf16")?;
            check_len("dv_aligned", io.dv_aligned.len, kv_len, "[W, 4, 128] bf16")?;
        }
        if t > 0 && (w == 0 || !w.is_multiple_of(BLOCK_SIZE)) {
            return Err(RuntimeError::input(
                "schedule.workspace_rows",
                w,
                "a positive multiple of 128",
            ));
        }
        check_buffers(io, self.in_place)?;

        if let BackwardSchedule::Device(s) = schedule {
            if s.memory_space() != backend.memory_space() {
                return Err(RuntimeError::input(
                    "schedule",
                    "a resident schedule of another memory space",
                    "one built on this backend's device",
                ));
            }
        }

        Ok(CallSizes {
            shape,
            w,
            t,
            tq,
            pool_rows,
            q_len,
            kv_len,
        })
    }

    /// The checks of [`MsaBackward::run_to_pools`] alone, so that a caller can validate the
    /// whole call before it issues work of its own (`crate::cp` gathers K/V first).
    pub(crate) fn check_to_pools(
        &self,
        backend: &B,
        io: &BackwardBuffers,
        schedule: &BackwardSchedule<'_, B>,
        kv_rows: usize,
    ) -> Result<(), RuntimeError> {
        self.check_call(backend, io, schedule, KvOut::Pools { rows: kv_rows })
            .map(|_| ())
    }

    fn run_inner(
        &mut self,
        backend: &mut B,
        io: &BackwardBuffers,
        schedule: BackwardSchedule<'_, B>,
        kv_out: KvOut,
        before_main: Option<BeforeMain<'_, B>>,
    ) -> Result<Option<KvPools>, RuntimeError> {
        let CallSizes {
            shape,
            w,
            t,
            tq,
            pool_rows,
            q_len,
            kv_len,
        } = self.check_call(backend, io, &schedule, kv_out)?;

        // 2. Architecture dispatch and kernel loading (JIT errors surface here).
        self.adopt(backend);
        let det = self.deterministic;
        let main = main_kernel_for(backend.capability(), backend.ordinal(), det)?;
        if t == 0 {
            // No tokens: no kernel to run (a validated Schedule always has T >= 1).
            backend.zero("dk_aligned", io.dk_aligned.addr, 2 * kv_len)?;
            backend.zero("dv_aligned", io.dv_aligned.addr, 2 * kv_len)?;
            return Ok(None);
        }
        for k in backward_kernels(det).iter().copied().chain([main]) {
            backend.load(k)?;
        }
        let sizes = TaskBuildSizes::for_shape(shape, backend.sm_count(), self.locality)?;
        let grid = sizes.main_grid()?;

        // 3. Tensor maps.
        let tmap_q = backend.tensor_map(&TileMapSpec::query_rows("q", tq)?, io.q.addr)?;
        let tmap_do =
            backend.tensor_map(&TileMapSpec::query_rows("grad_out", tq)?, io.grad_out.addr)?;
        let tmap_k =
            backend.tensor_map(&TileMapSpec::key_rows("k_aligned", w)?, io.k_aligned.addr)?;
        let tmap_v =
            backend.tensor_map(&TileMapSpec::key_rows("v_aligned", w)?, io.v_aligned.addr)?;

        // 4. Workspaces and the schedule's device buffer (allocations only).
        let separate_dq = dq_needs_pool(io)?;
        let pools = ensure_pools(
            &mut self.pools,
            &mut self.allocations,
            backend,
            (tq, pool_rows),
            separate_dq,
            det,
        )?;
        // The deterministic mode's fixed-point pools and bounds (None in the default mode).
        let fixed = pools.fixed_point(tq, pool_rows);
        // The main kernel reduces dQ into `io.dq` itself (see `DqLayout`) unless `dq` lies on
        // one of its inputs.
        let dq_pool = match pools.layout.dq_pool {
            Some(at) if separate_dq => pools.span::<bf16>(at, q_len),
            _ => io.dq,
        };
        let pool_len = pool_rows * KV_ROW;
        let (dk_pool, dv_pool, delta) = (
            pools.span::<f32>(pools.layout.dk_pool, pool_len),
            pools.span::<f32>(pools.layout.dv_pool, pool_len),
            pools.span::<f32>(pools.layout.delta, tq * NUM_Q_HEADS),
        );
        // The default kernels' dQ pool as a TMA reduce-add target, Q's geometry (the Hopper
        // kernel reduces through it; the Blackwell kernel takes it unused).
        // The deterministic kernels take none (their dQ pool is fixed-point).
        let tmap_dq = match fixed {
            None => Some(backend.tensor_map(&TileMapSpec::query_rows("dq", tq)?, dq_pool.addr)?),
            Some(_) => None,
        };
        let tasks = ensure_tasks(
            &mut self.tasks,
            &mut self.allocations,
            backend,
            sizes,
            shape.work_capacity,
        )?;
        let upload = match &schedule {
            BackwardSchedule::Host(s) => Some((*s, DeviceSchedule::allocate(backend, s)?)),
            BackwardSchedule::Device(_) => None,
        };

        // 5. The launch sequence (`docs/design.md` §3.1). The schedule copy follows the first
        // launches so that the GPU has work while the host stages it.
        // The copy runs beside the preprocess and the zeroing (`fork_uploads`: on the CUDA
        // backend, the device's upload stream) and is joined before the task build reads it.
        if upload.is_some() {
            backend.fork_uploads()?;
        }
        let issued = (|| -> Result<ScheduleRefs, RuntimeError> {
            match &fixed {
                Some(f) => {
                    // The preprocess stores every a[t, g]; only the group maxima, which its CTAs
                    // fold in with atomic max, start from zero.
                    backend.zero("bounds", f.bounds.addr, 4 * f.bounds.len)?;
                    preprocess_deterministic(
                        backend,
                        io.out,
                        io.grad_out,
                        io.q,
                        io.k_aligned,
                        io.v_aligned,
                        delta,
                        f,
                        tq,
                        w,
                    )?;
                    backend.zero("dq pool", f.dq.addr, 4 * f.dq.len)?;
                    backend.zero("dk pool", f.dk.addr, 4 * f.dk.len)?;
                    backend.zero("dv pool", f.dv.addr, 4 * f.dv.len)?;
                }
                None => {
                    preprocess(backend, io.out, io.grad_out, delta, tq)?;
                    // After the preprocess: `dq` may lie on `out` (in place), which only it reads.
                    backend.zero("dq pool", dq_pool.addr, 2 * q_len)?;
                    backend.zero("dk pool", dk_pool.addr, 4 * pool_len)?;
                    backend.zero("dv pool", dv_pool.addr, 4 * pool_len)?;
                }
            }
            Ok(match (&upload, &schedule) {
                (Some((s, d)), _) => {
                    d.write(backend, s)?;
                    d.refs()
                }
                (None, BackwardSchedule::Device(s)) => s.refs(),
                (None, BackwardSchedule::Host(_)) => unreachable!("host schedules are uploaded"),
            })
        })();
        // Joined whatever happened, so that neither later work nor a graph being captured is
        // left with an unjoined upload.
        let joined = backend.join_uploads();
        let refs = issued?;
        joined?;
        tasks.build_from(backend, &refs)?;
        // The caller's last step before the main kernel, the first reader of K/V (the
        // context-parallel gather's wait).
        if let Some(f) = before_main {
            f(backend)?;
        }
        if grid > 0 {
            let args = match &fixed {
                Some(f) => msa_backward_sm90_det::args(
                    &tmap_q,
                    &tmap_do,
                    &tmap_k,
                    &tmap_v,
                    io.lse.ptr(),
                    delta.ptr(),
                    tasks.task_meta(),
                    tasks.task_qrows(),
                    tasks.task_qpos(),
                    tasks.desc(),
                    f.dq.ptr_mut(),
                    f.dk.ptr_mut(),
                    f.dv.ptr_mut(),
                    f.row_bounds.ptr(),
                    f.bounds.ptr(),
                ),
                None => msa_backward_sm90::args(
                    &tmap_q,
                    &tmap_do,
                    &tmap_k,
                    &tmap_v,
                    io.lse.ptr(),
                    delta.ptr(),
                    tasks.task_meta(),
                    tasks.task_qrows(),
                    tasks.task_qpos(),
                    tasks.desc(),
                    dq_pool.ptr_mut(),
                    dk_pool.ptr_mut(),
                    dv_pool.ptr_mut(),
                    tmap_dq.as_ref().expect("the default mode encodes it"),
                ),
            };
            // SAFETY: both main kernels take these parameters (the parameter lists are one
            // declaration, `common::main_params`, checked by a test); the maps span q/grad_out
            // [T,64,128] and k/v [W,4,128], whose lengths were checked; lse, delta and the
            // pools are [T,64], [T,64], [T,64,128] and [W,4,128]; the task tables come from a
            // workspace built for `sizes`, whose grid bound is `grid`.
            unsafe { backend.launch(main, (grid, 1, 1), &args) }?;
        }
        // dQ: the Hopper kernel's reductions land in `[T, 64, 128]` already, so only a
        // separate pool needs a copy; the Blackwell kernel's head-pair-interleaved ones are
        // de-interleaved by the postprocess (in place when the pool is `io.dq`).
        let deinterleave = fixed.is_none() && dq_layout(main) == DqLayout::HeadPairs;
        if fixed.is_none() && !deinterleave && dq_pool.addr != io.dq.addr {
            backend.copy("dq", io.dq.addr, dq_pool.addr, 2 * q_len)?;
        }
        let (dq_from, dq_to, dq_tokens) = if deinterleave {
            (dq_pool, io.dq, tq)
        } else {
            (
                Span::<bf16>::new(dq_pool.addr, 0),
                Span::<bf16>::new(io.dq.addr, 0),
                0,
            )
        };
        let returned = match (kv_out, &fixed) {
            (KvOut::Aligned, Some(f)) => {
                postprocess_deterministic(backend, f, io.dq, io.dk_aligned, io.dv_aligned, tq, w)?;
                None
            }
            (KvOut::Aligned, None) => {
                postprocess(
                    backend,
                    dq_from,
                    dk_pool.prefix(kv_len),
                    dv_pool.prefix(kv_len),
                    dq_to,
                    io.dk_aligned,
                    io.dv_aligned,
                    dq_tokens,
                    w,
                )?;
                None
            }
            (KvOut::Pools { .. }, _) => {
                let (none_f32, none) = (
                    Span::<f32>::new(dk_pool.addr, 0),
                    Span::<bf16>::new(io.dk_aligned.addr, 0),
                );
                postprocess(
                    backend, dq_from, none_f32, none_f32, dq_to, none, none, dq_tokens, 0,
                )?;
                Some((dk_pool, dv_pool))
            }
        };
        // Replacing the previous upload frees it stream-ordered behind that call's kernels.
        // A resident schedule leaves it alone: dropping it there would free inside a capture.
        if let Some((_, d)) = upload {
            self.schedule = Some(d);
        }
        Ok(returned)
    }
}

/// The sizes [`MsaBackward::check_call`] derives from a call.
struct CallSizes {
    shape: ScheduleShape,
    w: usize,
    t: usize,
    tq: usize,
    pool_rows: usize,
    q_len: usize,
    kv_len: usize,
}

/// The fp32 dK and dV pools `[rows, 4, 128]` a context-parallel rank's backward leaves.
type KvPools = (Span<f32>, Span<f32>);

/// A step of the caller's, run right before the main kernel is issued
/// ([`MsaBackward::run_to_pools`]).
type BeforeMain<'a, B> = &'a mut dyn FnMut(&mut B) -> Result<(), RuntimeError>;

/// Where [`MsaBackward::run_inner`] leaves dK/dV.
#[derive(Debug, Clone, Copy)]
enum KvOut {
    /// Postprocessed into `io.dk_aligned`/`io.dv_aligned` (the public backward).
    Aligned,
    /// Left in the fp32 pools of `rows >= W` rows (a context-parallel rank's partial sums).
    Pools { rows: usize },
}

/// The gradient pools, grown (never shrunk) to hold `(t, w)`, and a dQ pool when `dq_pool`
/// (kept once it exists).
fn ensure_pools<'a, B: Backend>(
    slot: &'a mut Option<GradientPools<B>>,
    allocations: &mut usize,
    backend: &mut B,
    (t, w): (usize, usize),
    dq_pool: bool,
    fixed: bool,
) -> Result<&'a mut GradientPools<B>, RuntimeError> {
    let pools = match slot.take() {
        Some(p) if p.fits(t, w, dq_pool, fixed) => p,
        old => {
            // A workspace of the other mode gives no sizes to keep: its regions differ.
            let (ct, cw, cq) = old
                .as_ref()
                .filter(|p| p.layout.is_deterministic() == fixed)
                .map_or((0, 0, false), |p| {
                    (
                        p.layout.num_tokens,
                        p.layout.workspace_rows,
                        p.layout.dq_pool.is_some(),
                    )
                });
            let layout = if fixed {
                PoolLayout::deterministic(t.max(ct), w.max(cw))?
            } else {
                PoolLayout::new(t.max(ct), w.max(cw), dq_pool || cq)?
            };
            // Free the smaller one first (stream-ordered) to keep the peak down.
            drop(old);
            let p = GradientPools::new(backend, layout)?;
            *allocations += 1;
            p
        }
    };
    Ok(slot.insert(pools))
}

/// The task-build workspace, reused while it fits `sizes` exactly.
fn ensure_tasks<'a, B: Backend>(
    slot: &'a mut Option<TaskWorkspace<B>>,
    allocations: &mut usize,
    backend: &mut B,
    sizes: TaskBuildSizes,
    work_capacity: usize,
) -> Result<&'a mut TaskWorkspace<B>, RuntimeError> {
    let tasks = match slot.take() {
        Some(ws) if ws.fits(&sizes, work_capacity) => ws,
        old => {
            drop(old);
            let ws = TaskWorkspace::new(backend, sizes, work_capacity)?;
            *allocations += 1;
            ws
        }
    };
    Ok(slot.insert(tasks))
}

//! The MSA forward (`docs/design.md` §1.4): `out [T, 64, 128]` bf16 and `lse [T, 64]` f32
//! (natural log, what [`run_backward`](crate::run_backward) reads) from Q, the aligned K/V and
//! the selection `q2k`, on the device schedule the backward then reuses.
//!
//! - [`MsaForward::run_on`] is the host flow against any [`Backend`] (the CUDA driver or the
//!   simulator): checks, kernel dispatch by capability, tensor maps, one launch.
//! - [`run_forward`] builds the [`ResidentSchedule`] from the device `q2k` and `cu_seqlens`
//!   and runs the forward on it, all on one stream with no host sync, and returns `out`, `lse`
//!   and the schedule.
//! - [`MsaAttention`] pairs the two directions: its forward keeps `out`, `lse` and the
//!   schedule in a [`Saved`], which its backward takes, so a training step is two calls.
//!
//! Semantics: query `t` of document `d`, head `h` attends the keys of the blocks in
//! `q2k[h/16, t, :]` (document-local ids, `−1` skipped) at or before `t`; a row with no key
//! gets `out = 0`, `lse = −∞`. A selection the schedule build flags (an id past the own block,
//! a repeat, a malformed `cu_seqlens`; see [`ResidentSchedule::status`]) makes every row empty,
//! so `out` is 0 and `lse` −∞ and the backward on it writes zero gradients: never wrong values.

use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream, CudaView, DevicePtrMut};
use half::bf16;

use crate::backend::{Backend, KernelSpec, Span};
use crate::backward::{check_context, Gradients, MsaBackward, TileMapSpec};
use crate::buffers::{check_regions, Region};
use crate::contract::{BLOCK_SIZE, NUM_INDEX_HEADS, NUM_Q_HEADS, TOPK_BLOCKS};
use crate::cuda::{read_span, CudaBackend};
use crate::error::RuntimeError;
use crate::kernels::msa_forward_sm90;
use crate::ops::check_len;
use crate::schedule_build::{ResidentSchedule, ScheduleBuildSizes};

/// Elements of one token's Q or O row, `64 × 128`.
const Q_ROW: usize = NUM_Q_HEADS * crate::contract::HEAD_DIM;
/// Elements of one aligned K/V row, `4 × 128`.
const KV_ROW: usize = crate::contract::NUM_KV_HEADS * crate::contract::HEAD_DIM;
/// Query rows per forward work item (the kernel's `ITEM_QUERIES`).
pub const FORWARD_ITEM_QUERIES: usize = 8;
/// Queries per work item of the schedule the forward builds (what the backward measured
/// best with; any positive multiple of 8 is valid).
pub const QUERIES_PER_WORK: usize = 64;

/// The device buffers of one forward call; `T` and `W` come from the schedule's sizes.
#[derive(Debug, Clone, Copy)]
pub struct ForwardBuffers {
    /// `q [T, 64, 128]` bf16.
    pub q: Span<bf16>,
    /// `k_aligned [W, 4, 128]` bf16 in the schedule's aligned layout, zero padding rows.
    pub k_aligned: Span<bf16>,
    /// `v_aligned`, as `k_aligned`.
    pub v_aligned: Span<bf16>,
    /// `q2k [4, T, 16]` int32, the selection the schedule was built from.
    pub q2k: Span<i32>,
    /// Output `out [T, 64, 128]` bf16.
    pub out: Span<bf16>,
    /// Output `lse [T, 64]` f32.
    pub lse: Span<f32>,
}

/// The forward kernel for compute capability `cc`.
///
/// # Errors
/// [`RuntimeError::UnsupportedArch`] for a capability without a forward kernel (the Hopper
/// kernel runs on 9.0; the Blackwell forward is not built yet).
pub fn forward_kernel(cc: (i32, i32), ordinal: usize) -> Result<&'static KernelSpec, RuntimeError> {
    let k = &msa_forward_sm90::KERNEL;
    k.ptx(cc, ordinal)?;
    Ok(k)
}

/// Launch grid of the forward: one CTA per SM at most, never more than the items.
pub fn forward_grid(num_tokens: usize, sm_count: usize) -> u32 {
    let items = NUM_INDEX_HEADS * num_tokens.div_ceil(FORWARD_ITEM_QUERIES);
    items.min(sm_count.max(1)).min(i32::MAX as usize) as u32
}

/// The forward's host flow, written against [`Backend`]. It holds no device memory.
#[derive(Debug, Default, Clone, Copy)]
pub struct MsaForward;

impl MsaForward {
    /// Issues the forward on `backend`'s stream: checks, tensor maps, one launch of the main
    /// kernel. `schedule` must have been built from the same `q2k` and the `cu_seqlens` of
    /// these tensors ([`ResidentSchedule::build`]), earlier on the same stream.
    ///
    /// # Errors
    /// - [`RuntimeError::Input`] naming the field for a wrong length, a misaligned base, or a
    ///   schedule of another memory space; [`RuntimeError::NullBuffer`];
    ///   [`RuntimeError::Overlap`] for an output on an input or the other output.
    /// - [`RuntimeError::UnsupportedArch`] on a capability without a forward kernel.
    /// - Tensor-map, JIT and launch errors from the backend.
    pub fn run_on<B: Backend>(
        &self,
        backend: &mut B,
        io: &ForwardBuffers,
        schedule: &ResidentSchedule<B>,
    ) -> Result<(), RuntimeError> {
        let z = *schedule.sizes();
        let (t, w) = (z.num_tokens, z.workspace_rows);
        check_len("q", io.q.len, t * Q_ROW, "[T, 64, 128] bf16")?;
        check_len(
            "k_aligned",
            io.k_aligned.len,
            w * KV_ROW,
            "[W, 4, 128] bf16",
        )?;
        check_len(
            "v_aligned",
            io.v_aligned.len,
            w * KV_ROW,
            "[W, 4, 128] bf16",
        )?;
        let q2k_len = NUM_INDEX_HEADS * t * TOPK_BLOCKS;
        check_len("q2k", io.q2k.len, q2k_len, "[4, T, 16] int32")?;
        check_len("out", io.out.len, t * Q_ROW, "[T, 64, 128] bf16")?;
        check_len("lse", io.lse.len, t * NUM_Q_HEADS, "[T, 64] f32")?;
        if schedule.memory_space() != backend.memory_space() {
            return Err(RuntimeError::input(
                "schedule",
                "a resident schedule of another memory space",
                "one built on this backend's device",
            ));
        }
        if t == 0 {
            return Ok(());
        }
        if w == 0 || !w.is_multiple_of(BLOCK_SIZE) {
            return Err(RuntimeError::input(
                "schedule.workspace_rows",
                w,
                "a positive multiple of 128",
            ));
        }
        check_regions(
            &[
                Region::input("q", io.q)?,
                Region::input("k_aligned", io.k_aligned)?,
                Region::input("v_aligned", io.v_aligned)?,
                Region::input("q2k", io.q2k)?,
                Region::output("out", io.out)?,
                Region::output("lse", io.lse)?,
            ],
            false,
            "no in-place forward",
        )?;
        let kernel = forward_kernel(backend.capability(), backend.ordinal())?;
        backend.load(kernel)?;
        let tmap_q = backend.tensor_map(&TileMapSpec::query_rows("q", t)?, io.q.addr)?;
        let tmap_k =
            backend.tensor_map(&TileMapSpec::key_rows("k_aligned", w)?, io.k_aligned.addr)?;
        let tmap_v =
            backend.tensor_map(&TileMapSpec::key_rows("v_aligned", w)?, io.v_aligned.addr)?;
        let refs = schedule.refs();
        let grid = forward_grid(t, backend.sm_count());
        let args = msa_forward_sm90::args(
            &tmap_q,
            &tmap_k,
            &tmap_v,
            io.q2k.ptr(),
            Span::<i32>::new(refs.cu_seqlens, z.num_documents + 1).ptr(),
            Span::<i32>::new(refs.ws_starts, z.num_documents).ptr(),
            schedule.status_ptr(),
            io.out.ptr_mut(),
            io.lse.ptr_mut(),
            t as u32,
            z.num_documents as u32,
        );
        // SAFETY: the maps span q [T,64,128] and k/v [W,4,128], whose lengths were checked;
        // q2k is [4,T,16], out [T,64,128], lse [T,64]; cu_seqlens [D+1], the workspace starts
        // [D] and the status block belong to a schedule allocated for (T, D, W).
        unsafe { backend.launch(kernel, (grid, 1, 1), &args) }
    }
}

/// What [`run_forward`] returns.
pub struct ForwardOutput {
    /// `out [T, 64, 128]` bf16.
    pub out: CudaSlice<bf16>,
    /// `lse [T, 64]` f32, natural log.
    pub lse: CudaSlice<f32>,
    /// The schedule built from `q2k` and `cu_seqlens`, for the backward.
    pub schedule: ResidentSchedule<CudaBackend>,
}

impl std::fmt::Debug for ForwardOutput {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ForwardOutput")
            .field("out", &self.out.len())
            .field("lse", &self.lse.len())
            .field("schedule", &self.schedule)
            .finish()
    }
}

/// Builds the device schedule from `q2k [4, T, 16]` and `cu_seqlens [D+1]` (int32, device)
/// and runs the forward on it: `out`, `lse` and the schedule, all enqueued on `stream` with no
/// host sync. `k_aligned`/`v_aligned` are `[W, 4, 128]` bf16 in the dense aligned layout of
/// `cu_seqlens` ([`crate::to_aligned`] makes them) or any `W` at least that large.
///
/// # Errors
/// Those of [`ScheduleBuildSizes::new`], [`ResidentSchedule::build`] and
/// [`MsaForward::run_on`]; [`RuntimeError::Input`] for a buffer of another context or a
/// length that is not a whole number of rows; [`RuntimeError::Alloc`].
pub fn run_forward(
    stream: &Arc<CudaStream>,
    q: &CudaView<'_, bf16>,
    k_aligned: &CudaView<'_, bf16>,
    v_aligned: &CudaView<'_, bf16>,
    q2k: &CudaView<'_, i32>,
    cu_seqlens: &CudaView<'_, i32>,
) -> Result<ForwardOutput, RuntimeError> {
    for (field, len, row) in [
        ("q", q.len(), Q_ROW),
        ("k_aligned", k_aligned.len(), KV_ROW),
    ] {
        if !len.is_multiple_of(row) {
            return Err(RuntimeError::input(
                field,
                format!("{len} elements"),
                format!("a multiple of {row} (whole rows)"),
            ));
        }
    }
    if cu_seqlens.len() < 2 {
        return Err(RuntimeError::input(
            "cu_seqlens",
            format!("{} elements", cu_seqlens.len()),
            "[D+1] with at least one document",
        ));
    }
    check_context("q", q, stream)?;
    check_context("k_aligned", k_aligned, stream)?;
    check_context("v_aligned", v_aligned, stream)?;
    check_context("q2k", q2k, stream)?;
    check_context("cu_seqlens", cu_seqlens, stream)?;
    let (t, w, d) = (
        q.len() / Q_ROW,
        k_aligned.len() / KV_ROW,
        cu_seqlens.len() - 1,
    );
    let mut backend = CudaBackend::new(stream)?;
    // Before anything is enqueued: a device without a forward kernel gets its error at once.
    forward_kernel(backend.capability(), backend.ordinal())?;
    let sizes = ScheduleBuildSizes::new(t, d, w, QUERIES_PER_WORK)?;
    let mut schedule = ResidentSchedule::new(&mut backend, sizes)?;
    let alloc_err = |what, bytes| {
        move |source| RuntimeError::Alloc {
            what,
            bytes,
            source,
        }
    };
    // SAFETY: the forward writes every element of both (empty rows get 0 and −∞).
    let mut out = unsafe { stream.alloc::<bf16>(t.max(1) * Q_ROW) }
        .map_err(alloc_err("out", 2 * t * Q_ROW))?;
    let mut lse = unsafe { stream.alloc::<f32>(t.max(1) * NUM_Q_HEADS) }
        .map_err(alloc_err("lse", 4 * t * NUM_Q_HEADS))?;
    {
        let (q2k_s, _q2k) = read_span(q2k, stream);
        let (cu_s, _cu) = read_span(cu_seqlens, stream);
        schedule.build(&mut backend, q2k_s, cu_s)?;
        let (q, _q) = read_span(q, stream);
        let (k_aligned, _k) = read_span(k_aligned, stream);
        let (v_aligned, _v) = read_span(v_aligned, stream);
        let (out_ptr, _o) = out.device_ptr_mut(stream);
        let (lse_ptr, _l) = lse.device_ptr_mut(stream);
        let io = ForwardBuffers {
            q,
            k_aligned,
            v_aligned,
            q2k: q2k_s,
            out: Span::new(out_ptr, t * Q_ROW),
            lse: Span::new(lse_ptr, t * NUM_Q_HEADS),
        };
        MsaForward.run_on(&mut backend, &io, &schedule)?;
    }
    Ok(ForwardOutput { out, lse, schedule })
}

/// What [`MsaAttention::forward`] keeps for the backward: `out`, `lse` and the schedule.
pub type Saved = ForwardOutput;

/// The MSA attention as a pair of calls: [`MsaAttention::forward`] returns `out` with a
/// [`Saved`] context; [`MsaAttention::backward`] takes it with `grad_out` and returns the
/// gradients, reusing the forward's `out`, `lse` and device schedule (no second schedule
/// build, no host sync in either call). Owns the backward's cached workspace.
#[derive(Debug, Default)]
pub struct MsaAttention {
    backward: MsaBackward,
}

impl MsaAttention {
    /// A fresh pair (nothing allocated until the first backward).
    pub fn new() -> Self {
        Self::default()
    }

    /// The forward: [`run_forward`].
    ///
    /// # Errors
    /// Those of [`run_forward`].
    pub fn forward(
        &mut self,
        stream: &Arc<CudaStream>,
        q: &CudaView<'_, bf16>,
        k_aligned: &CudaView<'_, bf16>,
        v_aligned: &CudaView<'_, bf16>,
        q2k: &CudaView<'_, i32>,
        cu_seqlens: &CudaView<'_, i32>,
    ) -> Result<Saved, RuntimeError> {
        run_forward(stream, q, k_aligned, v_aligned, q2k, cu_seqlens)
    }

    /// The backward of the forward that returned `saved`, on the same `q`, `k_aligned` and
    /// `v_aligned`: `dq [T,64,128]`, `dk_aligned`, `dv_aligned [W,4,128]` (bf16).
    ///
    /// # Errors
    /// Those of [`MsaBackward::run`].
    pub fn backward(
        &mut self,
        stream: &Arc<CudaStream>,
        saved: &Saved,
        q: &CudaView<'_, bf16>,
        k_aligned: &CudaView<'_, bf16>,
        v_aligned: &CudaView<'_, bf16>,
        grad_out: &CudaView<'_, bf16>,
    ) -> Result<Gradients, RuntimeError> {
        let t = saved.schedule.sizes().num_tokens;
        let lse = saved.lse.slice(..t * NUM_Q_HEADS);
        let out = saved.out.slice(..t * Q_ROW);
        self.backward.run(
            stream,
            q,
            k_aligned,
            v_aligned,
            grad_out,
            &lse,
            &out,
            &saved.schedule,
        )
    }
}

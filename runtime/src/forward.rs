//! The MSA forward (`docs/design.md` §1.4): `out [T, 64, 128]` bf16 and `lse [T, 64]` f32
//! (natural log, what [`run_backward`](crate::run_backward) reads) from Q, the aligned K/V and
//! the selection `q2k`, on the device schedule the backward then reuses.
//!
//! - [`MsaForward::run_on`] is the host flow against any [`Backend`] (the CUDA driver or the
//!   simulator): checks, kernel dispatch by capability (`msa_forward_sm90` on 9.0,
//!   `msa_forward_sm100` on 10.0), tensor maps, one launch.
//! - [`run_forward`] builds the [`ResidentSchedule`] from the device `q2k` and `cu_seqlens`
//!   and runs the forward on it, all on one stream with no host sync, and returns `out`, `lse`
//!   and the schedule.
//! - [`MsaAttention`] pairs the two directions: its forward keeps `out`, `lse` and the
//!   schedule in a [`Saved`], which its backward takes, so a training step is two calls.
//!
//! Layer 3 (host flow, generic over [`Backend`]); the cudarc entry points ([`run_forward`],
//! [`MsaAttention`]) are layer 5, in `forward/stream.rs`.
//!
//! Semantics: query `t` of document `d`, head `h` attends the keys of the blocks in
//! `q2k[h/16, t, :]` (document-local ids, `−1` skipped) at or before `t`; a row with no key
//! gets `out = 0`, `lse = −∞`. A selection the schedule build flags (an id past the own block,
//! a repeat, a malformed `cu_seqlens`; see [`ResidentSchedule::status`]) makes every row empty,
//! so `out` is 0 and `lse` −∞ and the backward on it writes zero gradients: never wrong values.

use crate::backend::{Backend, KernelSpec, Ptr, Span, TileMapSpec};
use crate::contract::{BLOCK_SIZE, NUM_INDEX_HEADS};
use crate::error::RuntimeError;
use crate::forward_kv::{ForwardAlgorithm, MsaForwardKv};
use crate::kernels::{msa_forward_sm100, msa_forward_sm90};
use crate::ops::check_len;
use crate::schedule_build::ResidentSchedule;

pub(crate) mod buffers;
mod stream;
pub use buffers::ForwardBuffers;
pub use stream::{run_forward, ForwardOutput, MsaAttention, Saved};

pub(crate) use crate::contract::{KV_ROW, Q_ROW};
/// Query rows per forward work item (the kernel's `ITEM_QUERIES`).
pub const FORWARD_ITEM_QUERIES: usize = 8;
/// Queries per work item of the schedule the forward builds (what the backward measured
/// best with; any positive multiple of 8 is valid).
pub const QUERIES_PER_WORK: usize = 64;

/// The capabilities the forward has a kernel for, for error messages.
const SUPPORTED: &str = "9.0 (msa_forward_sm90), 10.0 (msa_forward_sm100)";

/// The forward kernel for compute capability `cc`; both variants take the same parameters.
///
/// # Errors
/// [`RuntimeError::UnsupportedArch`] on any capability but 9.0 and 10.0.
pub fn forward_kernel(cc: (i32, i32), ordinal: usize) -> Result<&'static KernelSpec, RuntimeError> {
    match cc {
        (9, 0) => Ok(&msa_forward_sm90::KERNEL),
        (10, 0) => Ok(&msa_forward_sm100::KERNEL),
        (major, minor) => Err(RuntimeError::UnsupportedArch {
            kernel: "msa_forward",
            ordinal,
            major,
            minor,
            supported: SUPPORTED.into(),
        }),
    }
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
        if schedule.memory_space() != backend.memory_space() {
            return Err(RuntimeError::input(
                "schedule",
                "a resident schedule of another memory space",
                "one built on this backend's device",
            ));
        }
        // A context-parallel rank's schedule (`ResidentSchedule::new_for_rows`) covers the
        // query rows it was made for: the kernel runs those, searching the documents at
        // their packed positions.
        let refs = schedule.refs();
        let q = schedule.query_rows();
        let rows = QueryRows {
            cu_seqlens: Span::new(schedule.cu_seqlens_ptr().addr(), z.num_documents + 1),
            ws_starts: Span::new(refs.ws_starts, z.num_documents),
            status: schedule.status_ptr(),
            first_token: q.start,
        };
        self.launch(backend, io, q.len(), z.workspace_rows, &rows)
    }

    /// The checks and the launch of [`MsaForward::run_on`], for `t` query rows (tokens
    /// `rows.first_token ..` of the packed sequence) against `w` aligned K/V rows.
    pub(crate) fn launch<B: Backend>(
        &self,
        backend: &mut B,
        io: &ForwardBuffers,
        t: usize,
        w: usize,
        rows: &QueryRows,
    ) -> Result<(), RuntimeError> {
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
        io.check_q2k_and_outputs(t)?;
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
        let docs = rows.ws_starts.len;
        check_len("cu_seqlens", rows.cu_seqlens.len, docs + 1, "[D + 1] int32")?;
        let num_docs = u32::try_from(docs)
            .map_err(|_| RuntimeError::input("num_docs", docs, "at most u32::MAX"))?;
        let first_token = u32::try_from(rows.first_token).map_err(|_| {
            RuntimeError::input("first_token", rows.first_token, "at most u32::MAX")
        })?;
        io.check_no_overlap()?;
        let kernel = forward_kernel(backend.capability(), backend.ordinal())?;
        backend.load(kernel)?;
        let tmap_q = backend.tensor_map(&TileMapSpec::query_rows("q", t)?, io.q.addr)?;
        let tmap_k =
            backend.tensor_map(&TileMapSpec::key_rows("k_aligned", w)?, io.k_aligned.addr)?;
        let tmap_v =
            backend.tensor_map(&TileMapSpec::key_rows("v_aligned", w)?, io.v_aligned.addr)?;
        let grid = forward_grid(t, backend.sm_count());
        // Both variants take the same parameters (`forward_sm90::forward_params`).
        let args = msa_forward_sm90::args(
            &tmap_q,
            &tmap_k,
            &tmap_v,
            io.q2k.ptr(),
            rows.cu_seqlens.ptr(),
            rows.ws_starts.ptr(),
            rows.status,
            io.out.ptr_mut(),
            io.lse.ptr_mut(),
            t as u32,
            num_docs,
            first_token,
        );
        // SAFETY: the maps span q [T,64,128] and k/v [W,4,128], whose lengths were checked;
        // q2k is [4,T,16], out [T,64,128], lse [T,64]; cu_seqlens [D+1] and the workspace
        // starts [D] were checked against each other, and the caller's `rows` holds a status
        // word and tables whose tokens cover `first_token .. first_token + T`.
        unsafe { backend.launch(kernel, (grid, 1, 1), &args) }
    }
}

/// Where a forward's query rows lie in the packed sequence, on the device: the documents'
/// `cu_seqlens [D+1]` and workspace starts `[D]`, the status word (non-zero: every row is
/// written empty), and the token of local row 0 (0 on one device; a context-parallel rank's
/// first token).
#[derive(Debug, Clone, Copy)]
pub(crate) struct QueryRows {
    pub cu_seqlens: Span<i32>,
    pub ws_starts: Span<i32>,
    pub status: Ptr<i32>,
    pub first_token: usize,
}

// Beside `MsaForward` rather than in `forward_kv`, which `forward/stream.rs` (re-exported
// here) imports: that would be an import circle.
impl ForwardAlgorithm {
    /// Runs the forward [`ForwardAlgorithm::uses_kv`] chose: with `kv` (its workspaces) the
    /// KV forward, without it the Q-parallel [`MsaForward`]. Under [`ForwardAlgorithm::Auto`]
    /// a KV forward whose workspace cannot be allocated falls back to the Q-parallel one,
    /// which needs none and overwrites every element of `out` and `lse`.
    ///
    /// # Errors
    /// Those of [`MsaForwardKv::run_on`] (but [`RuntimeError::Alloc`] under `Auto`) and of
    /// [`MsaForward::run_on`].
    pub fn run_on<B: Backend>(
        self,
        kv: Option<&mut MsaForwardKv<B>>,
        backend: &mut B,
        io: &ForwardBuffers,
        schedule: &ResidentSchedule<B>,
    ) -> Result<(), RuntimeError> {
        match kv.map(|kv| kv.run_on(backend, io, schedule)) {
            Some(Err(RuntimeError::Alloc { .. })) if self == ForwardAlgorithm::Auto => {
                MsaForward.run_on(backend, io, schedule)
            }
            Some(r) => r,
            None => MsaForward.run_on(backend, io, schedule),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn forward_kernel_picks_the_variant_by_capability() {
        assert_eq!(forward_kernel((9, 0), 0).unwrap().name, "msa_forward_sm90");
        assert_eq!(
            forward_kernel((10, 0), 0).unwrap().name,
            "msa_forward_sm100"
        );
        let e = forward_kernel((8, 9), 3).unwrap_err().to_string();
        assert!(
            e.contains("`msa_forward`")
                && e.contains("8.9 (device 3)")
                && e.contains("9.0 (msa_forward_sm90), 10.0 (msa_forward_sm100)"),
            "{e}"
        );
    }
}

//! Layer 5, the cudarc convenience API of the backward: [`MsaBackward::run`] on cudarc views,
//! and [`run_backward`] with its process-wide workspace cache.

use super::{BackwardBuffers, BackwardSchedule, MsaBackward};
use crate::backend::Span;
use crate::cuda::CudaBackend;
use crate::error::RuntimeError;
use crate::views::{check_context, read_span};
use cudarc::driver::{CudaSlice, CudaStream, CudaView, DevicePtrMut};
use half::bf16;
use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

/// The gradients of one backward call, all bf16.
pub struct Gradients {
    /// `dQ`, compact `[T, 64, 128]`.
    pub dq: CudaSlice<bf16>,
    /// `dK` in the aligned workspace layout `[W, 4, 128]`; padding rows are zero.
    pub dk_aligned: CudaSlice<bf16>,
    /// `dV` in the aligned workspace layout `[W, 4, 128]`; padding rows are zero.
    pub dv_aligned: CudaSlice<bf16>,
}

impl MsaBackward<CudaBackend> {
    /// [`MsaBackward::run_on`] on a CUDA stream with cudarc views; allocates and returns the
    /// gradients `dq [T,64,128]`, `dk_aligned`, `dv_aligned [W,4,128]`.
    ///
    /// Every input must belong to the stream's context. Everything is enqueued on `stream`
    /// without a host sync.
    ///
    /// # Errors
    /// Those of [`MsaBackward::run_on`], and [`RuntimeError::Input`] for a buffer of another
    /// context.
    #[allow(clippy::too_many_arguments)] // the seed's run_backward signature
    pub fn run<'s>(
        &mut self,
        stream: &Arc<CudaStream>,
        q: &CudaView<'_, bf16>,
        k_aligned: &CudaView<'_, bf16>,
        v_aligned: &CudaView<'_, bf16>,
        grad_out: &CudaView<'_, bf16>,
        lse: &CudaView<'_, f32>,
        out: &CudaView<'_, bf16>,
        schedule: impl Into<BackwardSchedule<'s, CudaBackend>>,
    ) -> Result<Gradients, RuntimeError> {
        check_context("q", q, stream)?;
        check_context("k_aligned", k_aligned, stream)?;
        check_context("v_aligned", v_aligned, stream)?;
        check_context("grad_out", grad_out, stream)?;
        check_context("lse", lse, stream)?;
        check_context("out", out, stream)?;
        let mut backend = CudaBackend::new(stream)?;
        // Outputs: sized from the inputs so that a length error is reported by `run_on`.
        let alloc = |len: usize| -> Result<CudaSlice<bf16>, RuntimeError> {
            let r = if len == 0 {
                stream.null()
            } else {
                // SAFETY: `run_on` writes every element (postprocess, or zeroing for T = 0).
                unsafe { stream.alloc::<bf16>(len) }
            };
            r.map_err(|source| RuntimeError::Alloc {
                what: "gradients",
                bytes: 2 * len,
                source,
            })
        };
        let (mut dq, mut dk, mut dv) = (
            alloc(q.len())?,
            alloc(k_aligned.len())?,
            alloc(v_aligned.len())?,
        );
        // The guards record the kernels' reads and writes for cudarc's cross-stream tracking,
        // which cannot see accesses through raw addresses and tensor maps; they are held until
        // everything is enqueued. (Taking a pointer enqueues at most an event wait.)
        let (q, _q) = read_span(q, stream);
        let (k_aligned, _k) = read_span(k_aligned, stream);
        let (v_aligned, _v) = read_span(v_aligned, stream);
        let (grad_out, _do) = read_span(grad_out, stream);
        let (lse, _lse) = read_span(lse, stream);
        let (out, _out) = read_span(out, stream);
        let (dq_len, dk_len, dv_len) = (dq.len(), dk.len(), dv.len());
        let (dq_ptr, _dq) = dq.device_ptr_mut(stream);
        let (dk_ptr, _dk) = dk.device_ptr_mut(stream);
        let (dv_ptr, _dv) = dv.device_ptr_mut(stream);
        let io = BackwardBuffers {
            q,
            k_aligned,
            v_aligned,
            grad_out,
            lse,
            out,
            dq: Span::new(dq_ptr, dq_len),
            dk_aligned: Span::new(dk_ptr, dk_len),
            dv_aligned: Span::new(dv_ptr, dv_len),
        };
        self.run_on(&mut backend, &io, schedule)?;
        drop((_dq, _dk, _dv));
        Ok(Gradients {
            dq,
            dk_aligned: dk,
            dv_aligned: dv,
        })
    }
}

/// One cached [`MsaBackward`] per CUDA context, for [`run_backward`].
fn cache() -> &'static Mutex<HashMap<usize, Arc<Mutex<MsaBackward>>>> {
    static CACHE: OnceLock<Mutex<HashMap<usize, Arc<Mutex<MsaBackward>>>>> = OnceLock::new();
    CACHE.get_or_init(Default::default)
}

/// The MSA backward (`docs/design.md` §1.5 `run_backward`) with a process-wide workspace cache per
/// CUDA context; see [`MsaBackward::run`] for the inputs, the launch sequence and the errors.
///
/// `k_aligned` and `v_aligned` must have zero padding rows: make them from compact K/V with
/// [`crate::to_aligned`], and bring the returned `dk_aligned`/`dv_aligned` back to compact rows
/// with [`crate::from_aligned`] (the crate-level guide has the whole sequence).
///
/// Calls on the same context serialize on the cache's lock while they enqueue (the GPU work
/// itself is asynchronous).
#[allow(clippy::too_many_arguments)] // the seed's run_backward signature
pub fn run_backward<'s>(
    stream: &Arc<CudaStream>,
    q: &CudaView<'_, bf16>,
    k_aligned: &CudaView<'_, bf16>,
    v_aligned: &CudaView<'_, bf16>,
    grad_out: &CudaView<'_, bf16>,
    lse: &CudaView<'_, f32>,
    out: &CudaView<'_, bf16>,
    schedule: impl Into<BackwardSchedule<'s, CudaBackend>>,
) -> Result<Gradients, RuntimeError> {
    let entry = {
        let mut map = cache().lock().unwrap_or_else(|e| e.into_inner());
        map.entry(stream.context().cu_ctx() as usize)
            .or_default()
            .clone()
    };
    // A panic mid-call leaves every cached field either valid or empty, so a poisoned lock is
    // safe to reuse.
    let mut backward = entry.lock().unwrap_or_else(|e| e.into_inner());
    backward.run(
        stream, q, k_aligned, v_aligned, grad_out, lse, out, schedule,
    )
}

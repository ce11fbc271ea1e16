//! Layer 5, the cudarc convenience API of the backward: [`MsaBackward::run`] on cudarc views,
//! and [`run_backward`] with its process-wide workspace cache.

use super::{BackwardBuffers, BackwardSchedule, MsaBackward};
use crate::backend::{Backend, Span};
use crate::cuda::CudaBackend;
use crate::error::RuntimeError;
use crate::views::{check_context, read_span};
use cudarc::driver::{sys, CudaSlice, CudaStream, CudaView, DevicePtrMut};
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

/// One cached [`MsaBackward`] per stream and mode, keyed by `(context, stream id,
/// deterministic)`.
type Cache = Mutex<HashMap<(u64, u64, bool), Arc<Mutex<MsaBackward>>>>;

fn cache() -> &'static Cache {
    static CACHE: OnceLock<Cache> = OnceLock::new();
    CACHE.get_or_init(Default::default)
}

/// The cached backward of `backend`'s stream in the given mode, made on first use.
fn cached(backend: &CudaBackend, deterministic: bool) -> Arc<Mutex<MsaBackward>> {
    let mut map = cache().lock().unwrap_or_else(|e| e.into_inner());
    map.entry((backend.memory_space(), backend.queue(), deterministic))
        .or_insert_with(|| {
            let mut b = MsaBackward::new();
            b.set_deterministic(deterministic);
            Arc::new(Mutex::new(b))
        })
        .clone()
}

/// The MSA backward (`docs/design.md` §1.5 `run_backward`) with a process-wide workspace cache per
/// stream; see [`MsaBackward::run`] for the inputs, the launch sequence and the errors.
///
/// `k_aligned` and `v_aligned` must have zero padding rows: make them from compact K/V with
/// [`crate::to_aligned`], and bring the returned `dk_aligned`/`dv_aligned` back to compact rows
/// with [`crate::from_aligned`] (the crate-level guide has the whole sequence).
///
/// # Concurrency
///
/// Each stream has its own cached workspace, allocated on that stream and used only there, so
/// calls from any number of threads on any number of streams never share one (see
/// [`MsaBackward`], "One stream at a time"). Calls on the same stream serialize on that
/// stream's lock while they enqueue; the GPU work itself is asynchronous. The cache keeps a
/// stream's workspace (and a handle to the stream) until [`release_workspace`]: call it
/// before dropping a stream that will not run the backward again, or the memory stays
/// allocated until the process ends.
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
    run_cached(
        false, stream, q, k_aligned, v_aligned, grad_out, lse, out, schedule,
    )
}

/// [`run_backward`] in the deterministic mode ([`MsaBackward::set_deterministic`]): the
/// gradients are the same bits on every call for the same inputs on the same device. The
/// stream's deterministic workspace is cached beside the default one (and released with it
/// by [`release_workspace`]).
#[allow(clippy::too_many_arguments)] // the seed's run_backward signature
pub fn run_backward_deterministic<'s>(
    stream: &Arc<CudaStream>,
    q: &CudaView<'_, bf16>,
    k_aligned: &CudaView<'_, bf16>,
    v_aligned: &CudaView<'_, bf16>,
    grad_out: &CudaView<'_, bf16>,
    lse: &CudaView<'_, f32>,
    out: &CudaView<'_, bf16>,
    schedule: impl Into<BackwardSchedule<'s, CudaBackend>>,
) -> Result<Gradients, RuntimeError> {
    run_cached(
        true, stream, q, k_aligned, v_aligned, grad_out, lse, out, schedule,
    )
}

#[allow(clippy::too_many_arguments)]
fn run_cached<'s>(
    deterministic: bool,
    stream: &Arc<CudaStream>,
    q: &CudaView<'_, bf16>,
    k_aligned: &CudaView<'_, bf16>,
    v_aligned: &CudaView<'_, bf16>,
    grad_out: &CudaView<'_, bf16>,
    lse: &CudaView<'_, f32>,
    out: &CudaView<'_, bf16>,
    schedule: impl Into<BackwardSchedule<'s, CudaBackend>>,
) -> Result<Gradients, RuntimeError> {
    let entry = cached(&CudaBackend::new(stream)?, deterministic);
    // A panic mid-call leaves every cached field either valid or empty, so a poisoned lock is
    // safe to reuse.
    let mut backward = entry.lock().unwrap_or_else(|e| e.into_inner());
    backward.run(
        stream, q, k_aligned, v_aligned, grad_out, lse, out, schedule,
    )
}

/// [`run_backward`] on a stream another library owns, with raw device buffers: for
/// frameworks whose cudarc version or stream type differs from this crate's (PyTorch through
/// a C ABI, burn/cubecl, whose streams are private, a CUDA C++ extension).
///
/// `stream` is the raw driver handle (cast with `as msa_runtime::cudarc::driver::sys::CUstream`;
/// a `cudaStream_t` is the same pointer), of a device's primary context; `io` holds the
/// device addresses and lengths of the inputs and of the outputs the call writes
/// (`dq [T, 64, 128]`, `dk_aligned`, `dv_aligned [W, 4, 128]` bf16; see [`BackwardBuffers`]
/// for every shape and the padding contract). Everything is enqueued on `stream` in its order,
/// with no host sync; the caller orders other streams' use of the buffers against it (an
/// event, as for any kernel of its own). The stream's cached workspace is the one
/// [`run_backward`] uses on the same stream.
///
/// # Safety
/// As [`CudaBackend::from_raw_stream`]: a valid stream that stays alive until
/// [`release_workspace_raw`] is called for it (the cache frees its workspace on it). Every
/// address in `io` must point at device memory of the stream's context holding the stated
/// number of elements (the lengths, bases, alignment and overlaps are checked; what lies
/// behind an address cannot be), alive until the enqueued work has finished.
///
/// # Errors
/// Those of [`CudaBackend::from_raw_stream`] and [`MsaBackward::run_on`].
pub unsafe fn run_backward_raw<'s>(
    stream: sys::CUstream,
    io: &BackwardBuffers,
    schedule: impl Into<BackwardSchedule<'s, CudaBackend>>,
) -> Result<(), RuntimeError> {
    // SAFETY: forwarded to the caller.
    let mut backend = unsafe { CudaBackend::from_raw_stream(stream) }?;
    let entry = cached(&backend, false);
    let mut backward = entry.lock().unwrap_or_else(|e| e.into_inner());
    backward.run_on(&mut backend, io, schedule)
}

/// Drops the cached workspace of `stream` ([`run_backward`]'s cache), freeing it
/// stream-ordered behind the work that used it, and the cache's handle to the stream.
/// Returns whether there was one. The next call on the stream allocates a new workspace.
///
/// # Errors
/// [`RuntimeError::Driver`] when the stream's id cannot be read.
pub fn release_workspace(stream: &Arc<CudaStream>) -> Result<bool, RuntimeError> {
    release(&CudaBackend::new(stream)?)
}

/// [`release_workspace`] for a raw stream handle ([`run_backward_raw`]'s cache); call it
/// before the stream's owner destroys the stream.
///
/// # Safety
/// `stream` must be a valid stream handle (not yet destroyed).
///
/// # Errors
/// Those of [`CudaBackend::from_raw_stream`].
pub unsafe fn release_workspace_raw(stream: sys::CUstream) -> Result<bool, RuntimeError> {
    // SAFETY: forwarded to the caller; the backend is dropped before this returns.
    release(&unsafe { CudaBackend::from_raw_stream(stream) }?)
}

fn release(backend: &CudaBackend) -> Result<bool, RuntimeError> {
    let entries: Vec<_> = {
        let mut map = cache().lock().unwrap_or_else(|e| e.into_inner());
        [false, true]
            .into_iter()
            .filter_map(|det| map.remove(&(backend.memory_space(), backend.queue(), det)))
            .collect()
    };
    // Waits for a call still enqueueing on this stream, then frees on the stream.
    let any = !entries.is_empty();
    for e in entries {
        drop(e.lock().unwrap_or_else(|p| p.into_inner()));
    }
    Ok(any)
}

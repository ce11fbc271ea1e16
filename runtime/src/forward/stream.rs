//! Layer 5, the cudarc convenience API of the forward: [`run_forward`] on cudarc views and the
//! paired [`MsaAttention`].

use super::{forward_kernel, ForwardBuffers, KV_ROW, QUERIES_PER_WORK, Q_ROW};
use crate::backend::{Backend, Span};
use crate::backward::{Gradients, MsaBackward};
use crate::contract::NUM_Q_HEADS;
use crate::cuda::CudaBackend;
use crate::error::RuntimeError;
use crate::forward_kv::{ForwardAlgorithm, MsaForwardKv};
use crate::schedule_build::{ResidentSchedule, ScheduleBuildSizes};
use crate::views::{check_context, read_span};
use cudarc::driver::{CudaSlice, CudaStream, CudaView, DevicePtrMut};
use half::bf16;
use std::sync::Arc;

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
/// and runs the Q-parallel forward on it (bitwise reproducible): `out`, `lse` and the
/// schedule, all enqueued on `stream` with no host sync. `k_aligned`/`v_aligned` are
/// `[W, 4, 128]` bf16 in the dense aligned layout of `cu_seqlens` ([`crate::to_aligned`] makes
/// them) or any `W` at least that large. [`MsaAttention`] can run the faster KV-parallel
/// forward on long documents ([`ForwardAlgorithm`]).
///
/// # Errors
/// Those of [`ScheduleBuildSizes::new`], [`ResidentSchedule::build`] and
/// [`MsaForward::run_on`](super::MsaForward::run_on); [`RuntimeError::Input`] for a buffer of
/// another context or a length that is not a whole number of rows; [`RuntimeError::Alloc`].
pub fn run_forward(
    stream: &Arc<CudaStream>,
    q: &CudaView<'_, bf16>,
    k_aligned: &CudaView<'_, bf16>,
    v_aligned: &CudaView<'_, bf16>,
    q2k: &CudaView<'_, i32>,
    cu_seqlens: &CudaView<'_, i32>,
) -> Result<ForwardOutput, RuntimeError> {
    let inputs = ForwardInputs {
        q,
        k_aligned,
        v_aligned,
        q2k,
        cu_seqlens,
    };
    forward_with(stream, &inputs, ForwardAlgorithm::QParallel, false, None)
}

/// The forward's device inputs.
struct ForwardInputs<'a, 'b> {
    q: &'a CudaView<'b, bf16>,
    k_aligned: &'a CudaView<'b, bf16>,
    v_aligned: &'a CudaView<'b, bf16>,
    q2k: &'a CudaView<'b, i32>,
    cu_seqlens: &'a CudaView<'b, i32>,
}

/// [`run_forward`] with the forward `algorithm` picks (`kv` holds the KV forward's
/// workspaces; `None` only for [`ForwardAlgorithm::QParallel`]).
fn forward_with(
    stream: &Arc<CudaStream>,
    x: &ForwardInputs<'_, '_>,
    algorithm: ForwardAlgorithm,
    deterministic: bool,
    kv: Option<&mut MsaForwardKv<CudaBackend>>,
) -> Result<ForwardOutput, RuntimeError> {
    for (field, len, row) in [
        ("q", x.q.len(), Q_ROW),
        ("k_aligned", x.k_aligned.len(), KV_ROW),
    ] {
        if !len.is_multiple_of(row) {
            return Err(RuntimeError::input(
                field,
                format!("{len} elements"),
                format!("a multiple of {row} (whole rows)"),
            ));
        }
    }
    if x.cu_seqlens.len() < 2 {
        return Err(RuntimeError::input(
            "cu_seqlens",
            format!("{} elements", x.cu_seqlens.len()),
            "[D+1] with at least one document",
        ));
    }
    check_context("q", x.q, stream)?;
    check_context("k_aligned", x.k_aligned, stream)?;
    check_context("v_aligned", x.v_aligned, stream)?;
    check_context("q2k", x.q2k, stream)?;
    check_context("cu_seqlens", x.cu_seqlens, stream)?;
    let (t, w, d) = (
        x.q.len() / Q_ROW,
        x.k_aligned.len() / KV_ROW,
        x.cu_seqlens.len() - 1,
    );
    let mut backend = CudaBackend::new(stream)?;
    // Before anything is enqueued: a device without the chosen kernel gets its error at once.
    let (cc, ordinal) = (backend.capability(), backend.ordinal());
    let kv = match (
        algorithm.uses_kv(cc, ordinal, (t, d, w), deterministic)?,
        kv,
    ) {
        (true, Some(kv)) => Some(kv),
        (true, None) => unreachable!("a KV forward is only chosen with its workspaces"),
        (false, _) => {
            forward_kernel(cc, ordinal)?;
            None
        }
    };
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
        let (q2k_s, _q2k) = read_span(x.q2k, stream);
        let (cu_s, _cu) = read_span(x.cu_seqlens, stream);
        schedule.build(&mut backend, q2k_s, cu_s)?;
        let (q, _q) = read_span(x.q, stream);
        let (k_aligned, _k) = read_span(x.k_aligned, stream);
        let (v_aligned, _v) = read_span(x.v_aligned, stream);
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
        algorithm.run_on(kv, &mut backend, &io, &schedule)?;
    }
    Ok(ForwardOutput { out, lse, schedule })
}

/// What [`MsaAttention::forward`] keeps for the backward: `out`, `lse` and the schedule.
pub type Saved = ForwardOutput;

/// The MSA attention as a pair of calls: [`MsaAttention::forward`] returns `out` with a
/// [`Saved`] context; [`MsaAttention::backward`] takes it with `grad_out` and returns the
/// gradients, reusing the forward's `out`, `lse` and device schedule (no second schedule
/// build, no host sync in either call). Owns the backward's cached workspace.
#[derive(Default)]
pub struct MsaAttention {
    backward: MsaBackward,
    algorithm: ForwardAlgorithm,
    /// The KV forward's workspaces (kept between calls, like the backward's).
    kv: MsaForwardKv<CudaBackend>,
}

impl std::fmt::Debug for MsaAttention {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MsaAttention")
            .field("backward", &self.backward)
            .field("algorithm", &self.algorithm)
            .finish()
    }
}

impl MsaAttention {
    /// A fresh pair (nothing allocated until the first backward).
    pub fn new() -> Self {
        Self::default()
    }

    /// The deterministic mode: the backward's ([`MsaBackward::set_deterministic`]), and a
    /// bitwise reproducible forward (the Q-parallel one, whatever the [`ForwardAlgorithm`]
    /// says, and an error for [`ForwardAlgorithm::KvParallel`]).
    pub fn set_deterministic(&mut self, on: bool) -> &mut Self {
        self.backward.set_deterministic(on);
        self
    }

    /// The forward algorithm (default [`ForwardAlgorithm::Auto`]); checked by the next
    /// forward.
    pub fn set_forward_algorithm(&mut self, algorithm: ForwardAlgorithm) -> &mut Self {
        self.algorithm = algorithm;
        self
    }

    /// The forward: [`run_forward`]'s schedule build, outputs and checks, with the kernel the
    /// [`ForwardAlgorithm`] picks. The KV forward keeps its workspaces for the next call on
    /// this stream. It needs no host sync; a row with a NaN or infinite logit gets `out = 0`,
    /// `lse = NaN` there (the Q-parallel forward lets the NaN through to `out`).
    ///
    /// # Errors
    /// Those of [`run_forward`] and [`ForwardAlgorithm::uses_kv`], and for the KV forward
    /// those of [`MsaForwardKv::run_on`].
    pub fn forward(
        &mut self,
        stream: &Arc<CudaStream>,
        q: &CudaView<'_, bf16>,
        k_aligned: &CudaView<'_, bf16>,
        v_aligned: &CudaView<'_, bf16>,
        q2k: &CudaView<'_, i32>,
        cu_seqlens: &CudaView<'_, i32>,
    ) -> Result<Saved, RuntimeError> {
        let inputs = ForwardInputs {
            q,
            k_aligned,
            v_aligned,
            q2k,
            cu_seqlens,
        };
        let deterministic = self.backward.deterministic();
        forward_with(
            stream,
            &inputs,
            self.algorithm,
            deterministic,
            Some(&mut self.kv),
        )
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

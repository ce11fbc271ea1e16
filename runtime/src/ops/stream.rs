//! Layer 5, the cudarc convenience API of the standalone kernels.

use super::{postprocess, preprocess};
use crate::backend::Span;
use crate::cuda::CudaBackend;
use crate::error::RuntimeError;
use crate::views::read_span;
use cudarc::driver::{CudaStream, CudaView, CudaViewMut, DevicePtrMut};
use half::bf16;
use std::sync::Arc;

/// [`preprocess`] on a CUDA stream, with cudarc views.
pub fn run_preprocess(
    stream: &Arc<CudaStream>,
    out: &CudaView<'_, bf16>,
    dout: &CudaView<'_, bf16>,
    delta: &mut CudaViewMut<'_, f32>,
    num_tokens: usize,
) -> Result<(), RuntimeError> {
    let mut backend = CudaBackend::new(stream)?;
    let (o, _o) = read_span(out, stream);
    let (d, _d) = read_span(dout, stream);
    let len = delta.len();
    let (x, _x) = delta.device_ptr_mut(stream);
    preprocess(&mut backend, o, d, Span::new(x, len), num_tokens)
}

/// [`postprocess`] on a CUDA stream, with cudarc views.
#[allow(clippy::too_many_arguments)]
pub fn run_postprocess(
    stream: &Arc<CudaStream>,
    dq_pool: &CudaView<'_, bf16>,
    dk_pool: &CudaView<'_, f32>,
    dv_pool: &CudaView<'_, f32>,
    dq: &mut CudaViewMut<'_, bf16>,
    dk: &mut CudaViewMut<'_, bf16>,
    dv: &mut CudaViewMut<'_, bf16>,
    num_tokens: usize,
    workspace_rows: usize,
) -> Result<(), RuntimeError> {
    let mut backend = CudaBackend::new(stream)?;
    let (a, _a) = read_span(dq_pool, stream);
    let (b, _b) = read_span(dk_pool, stream);
    let (c, _c) = read_span(dv_pool, stream);
    let (ld, le, lf) = (dq.len(), dk.len(), dv.len());
    let (d, _d) = dq.device_ptr_mut(stream);
    let (e, _e) = dk.device_ptr_mut(stream);
    let (f, _f) = dv.device_ptr_mut(stream);
    postprocess(
        &mut backend,
        a,
        b,
        c,
        Span::new(d, ld),
        Span::new(e, le),
        Span::new(f, lf),
        num_tokens,
        workspace_rows,
    )
}

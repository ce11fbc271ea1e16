//! Layer 5, the cudarc convenience API of the layout moves: [`to_aligned`] and
//! [`from_aligned`] allocate their outputs on the stream and take cudarc views.

use super::{from_aligned_on, to_aligned_on, KV_ROW};
use crate::backend::Span;
use crate::cuda::CudaBackend;
use crate::error::RuntimeError;
use crate::schedule::Schedule;
use crate::views::{check_context, read_span};
use cudarc::driver::{CudaSlice, CudaStream, CudaView, DevicePtrMut};
use half::bf16;
use std::sync::Arc;

/// Allocates two bf16 buffers of `len` elements on `stream`, each written whole by the
/// kernel that follows.
fn alloc_pair(
    stream: &Arc<CudaStream>,
    what: &'static str,
    len: usize,
) -> Result<[CudaSlice<bf16>; 2], RuntimeError> {
    let one = || {
        // SAFETY: the layout kernel launched right after writes every element.
        unsafe { stream.alloc::<bf16>(len) }.map_err(|source| RuntimeError::Alloc {
            what,
            bytes: 2 * len,
            source,
        })
    };
    Ok([one()?, one()?])
}

/// [`to_aligned_on`] on a CUDA stream: returns new `k_aligned`, `v_aligned` `[W, 4, 128]`
/// bf16, zero-padded, from compact `k`, `v` `[T, 4, 128]`. The documented way to make the
/// aligned inputs of [`crate::run_backward`].
///
/// # Errors
/// Those of [`to_aligned_on`], and [`RuntimeError::Input`] for a view of another context.
pub fn to_aligned(
    stream: &Arc<CudaStream>,
    schedule: &Schedule,
    k: &CudaView<'_, bf16>,
    v: &CudaView<'_, bf16>,
) -> Result<(CudaSlice<bf16>, CudaSlice<bf16>), RuntimeError> {
    check_context("k", k, stream)?;
    check_context("v", v, stream)?;
    let mut backend = CudaBackend::new(stream)?;
    let len = schedule.workspace_rows() * KV_ROW;
    let [mut ka, mut va] = alloc_pair(stream, "aligned K/V", len)?;
    let (k, _k) = read_span(k, stream);
    let (v, _v) = read_span(v, stream);
    {
        let (ka_ptr, _ka) = ka.device_ptr_mut(stream);
        let (va_ptr, _va) = va.device_ptr_mut(stream);
        to_aligned_on(
            &mut backend,
            schedule,
            k,
            v,
            Span::new(ka_ptr, len),
            Span::new(va_ptr, len),
        )?;
    }
    Ok((ka, va))
}

/// [`from_aligned_on`] on a CUDA stream: returns new compact `dk`, `dv` `[T, 4, 128]` bf16
/// from the `[W, 4, 128]` gradients of [`crate::run_backward`].
///
/// # Errors
/// Those of [`from_aligned_on`], and [`RuntimeError::Input`] for a view of another context.
pub fn from_aligned(
    stream: &Arc<CudaStream>,
    schedule: &Schedule,
    dk_aligned: &CudaView<'_, bf16>,
    dv_aligned: &CudaView<'_, bf16>,
) -> Result<(CudaSlice<bf16>, CudaSlice<bf16>), RuntimeError> {
    check_context("dk_aligned", dk_aligned, stream)?;
    check_context("dv_aligned", dv_aligned, stream)?;
    let mut backend = CudaBackend::new(stream)?;
    let len = schedule.num_tokens() * KV_ROW;
    let [mut dk, mut dv] = alloc_pair(stream, "compact dK/dV", len)?;
    let (dka, _dka) = read_span(dk_aligned, stream);
    let (dva, _dva) = read_span(dv_aligned, stream);
    {
        let (dk_ptr, _dk) = dk.device_ptr_mut(stream);
        let (dv_ptr, _dv) = dv.device_ptr_mut(stream);
        from_aligned_on(
            &mut backend,
            schedule,
            dka,
            dva,
            Span::new(dk_ptr, len),
            Span::new(dv_ptr, len),
        )?;
    }
    Ok((dk, dv))
}

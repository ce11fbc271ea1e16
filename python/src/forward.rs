//! `run_forward` on torch tensors: the checks, then `MsaForward::run_on` on the caller's CUDA
//! stream with the tensors' own memory, on a schedule built on the device.

use crate::backward::{check, Sched};
use crate::error;
use crate::schedule::ResidentSchedulePy;
use crate::{cuda_stream, CudaStreamHandle};
use msa_runtime::{CudaBackend, ForwardBuffers, MsaForward, RuntimeError};
use pyo3::prelude::*;

/// Runs the forward on `stream` (a `CUstream` of the tensors' device): reads `q`,
/// `k_aligned`, `v_aligned` and `q2k`, writes `out [T, 64, 128]` bf16 and `lse [T, 64]` f32 in
/// place, all through their `data_ptr()`. The schedule must be the one built on the device
/// from this `q2k` (`build_schedule` of a CUDA `q2k`); every tensor must be contiguous and
/// 16-byte aligned. Nothing is synchronized.
#[pyfunction]
#[allow(clippy::too_many_arguments)] // the forward's inputs, its two outputs and the stream
pub fn run_forward(
    py: Python<'_>,
    q: &Bound<'_, PyAny>,
    k_aligned: &Bound<'_, PyAny>,
    v_aligned: &Bound<'_, PyAny>,
    q2k: &Bound<'_, PyAny>,
    out: &Bound<'_, PyAny>,
    lse: &Bound<'_, PyAny>,
    schedule: &Bound<'_, PyAny>,
    stream: u64,
) -> PyResult<()> {
    let sched = schedule.cast::<ResidentSchedulePy>().map_err(|_| {
        error::type_error(
            "schedule",
            "another object",
            "a schedule built on the device (msa_ptx.build_schedule of a CUDA q2k)",
        )
    })?;
    let sched = sched.get();
    let names = ["q", "k_aligned", "v_aligned", "q2k", "out", "lse"];
    let args = check(
        &names,
        &[q, k_aligned, v_aligned, q2k, out, lse],
        &Sched::Resident(sched),
    )?;
    for tensor in &args.tensors {
        tensor.expect_dense(16)?;
    }
    let x = &args.tensors;
    let io = ForwardBuffers {
        q: x[0].span(),
        k_aligned: x[1].span(),
        v_aligned: x[2].span(),
        q2k: x[3].span(),
        out: x[4].span(),
        lse: x[5].span(),
    };
    py.detach(|| -> Result<(), RuntimeError> {
        let handle: CudaStreamHandle = cuda_stream(args.device, stream)?;
        let mut backend = CudaBackend::new(&handle.0)?;
        let s = sched.inner.lock().unwrap_or_else(|e| e.into_inner());
        MsaForward.run_on(&mut backend, &io, &s)
    })
    .map_err(error::runtime)
}

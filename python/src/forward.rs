//! `run_forward` on torch tensors: the checks, then `MsaForward::run_on` on the caller's CUDA
//! stream with the tensors' own memory, on a schedule built on the device.

use crate::error;
use crate::schedule::ResidentSchedulePy;
use crate::tensor::{common_device, Dtype, Tensor};
use crate::{cuda_stream, CudaStreamHandle};
use msa_runtime::{
    CudaBackend, ForwardBuffers, MsaForward, RuntimeError, Span, HEAD_DIM, NUM_INDEX_HEADS,
    NUM_KV_HEADS, NUM_Q_HEADS, TOPK_BLOCKS,
};
use pyo3::prelude::*;

/// One argument: its name, the object, and the dtype, shape and shape text it must have.
type Spec<'a, 'py> = (
    &'static str,
    &'a Bound<'py, PyAny>,
    Dtype,
    Vec<usize>,
    &'a String,
);

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
    let sizes = *sched
        .inner
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .sizes();
    let (t, w) = (sizes.num_tokens, sizes.workspace_rows);
    let q_text = format!("[T, 64, 128] with T = {t} (the schedule's tokens)");
    let kv_text = format!("[W, 4, 128] with W = {w} (the schedule's workspace rows)");
    let q2k_text = format!("[4, T, 16] with T = {t} (the schedule's tokens)");
    let lse_text = format!("[T, 64] with T = {t} (the schedule's tokens)");
    let specs: [Spec<'_, '_>; 6] = [
        ("q", q, Dtype::Bf16, vec![t, NUM_Q_HEADS, HEAD_DIM], &q_text),
        (
            "k_aligned",
            k_aligned,
            Dtype::Bf16,
            vec![w, NUM_KV_HEADS, HEAD_DIM],
            &kv_text,
        ),
        (
            "v_aligned",
            v_aligned,
            Dtype::Bf16,
            vec![w, NUM_KV_HEADS, HEAD_DIM],
            &kv_text,
        ),
        (
            "q2k",
            q2k,
            Dtype::I32,
            vec![NUM_INDEX_HEADS, t, TOPK_BLOCKS],
            &q2k_text,
        ),
        (
            "out",
            out,
            Dtype::Bf16,
            vec![t, NUM_Q_HEADS, HEAD_DIM],
            &q_text,
        ),
        ("lse", lse, Dtype::F32, vec![t, NUM_Q_HEADS], &lse_text),
    ];
    let mut x = Vec::with_capacity(specs.len());
    for (name, obj, dtype, shape, text) in specs {
        let tensor = Tensor::read(name, obj)?;
        tensor.expect_dtype(dtype)?;
        tensor.expect_shape(&shape, text)?;
        x.push(tensor);
    }
    let device = common_device(&x.iter().collect::<Vec<_>>())?;
    if sched.device != device {
        return Err(error::value_error(
            "schedule",
            format!("a schedule built on cuda:{}", sched.device),
            &format!("one built on the tensors' device, cuda:{device}"),
        ));
    }
    for tensor in &x {
        tensor.expect_dense(16)?;
    }
    fn span<T>(x: &Tensor) -> Span<T> {
        Span::new(x.ptr, x.numel())
    }
    let io = ForwardBuffers {
        q: span(&x[0]),
        k_aligned: span(&x[1]),
        v_aligned: span(&x[2]),
        q2k: span(&x[3]),
        out: span(&x[4]),
        lse: span(&x[5]),
    };
    py.detach(|| -> Result<(), RuntimeError> {
        let handle: CudaStreamHandle = cuda_stream(device, stream)?;
        let mut backend = CudaBackend::new(&handle.0)?;
        let s = sched.inner.lock().unwrap_or_else(|e| e.into_inner());
        MsaForward.run_on(&mut backend, &io, &s)
    })
    .map_err(error::runtime)
}

//! Context parallelism on torch tensors: `msa_runtime::CpLayout` as `msa_ptx.CPLayout`, and
//! one rank's forward and backward (`CpForward`, `CpBackward`) whose collectives call back
//! into Python, where `torch.distributed` runs them on the caller's process group.
//!
//! The callbacks run on the calling thread, so `torch.distributed` issues them on the same
//! current stream as the kernels: with NCCL a collective starts after the kernels enqueued
//! before it, and the kernels enqueued after it wait for it, with no host sync. The default
//! `Collective::wait` (nothing) is therefore enough.

use crate::error;
use crate::schedule::HostSchedule;
use crate::tensor::{common_device, Dtype, Tensor};
use crate::{cuda_stream, entry, Cache, CudaStreamHandle};
use half::bf16;
use msa_runtime::{
    Collective, CpBackward, CpBuffers, CpForward, CpForwardBuffers, CpLayout, RankSchedule,
};
use msa_runtime::{CudaBackend, RuntimeError, Span, HEAD_DIM, NUM_INDEX_HEADS, NUM_KV_HEADS};
use msa_runtime::{NUM_Q_HEADS, TOPK_BLOCKS};
use pyo3::prelude::*;
use std::sync::{Mutex, OnceLock};

/// How a packed sequence is split across the ranks of a context-parallel group (the rank
/// layout of `msa_runtime::cp`): rank `r` holds the compact tokens `token_rows(r)` and the
/// aligned K/V rows `[r·S, (r+1)·S)`, `S = slice_rows`.
#[pyclass(name = "CPLayout", module = "msa_ptx._native", frozen)]
pub struct CpLayoutPy {
    pub(crate) inner: CpLayout,
}

impl CpLayoutPy {
    fn check_rank(&self, rank: usize) -> PyResult<()> {
        if rank >= self.inner.ranks() {
            return Err(error::value_error(
                "rank",
                rank,
                &format!("below {} (the layout's ranks)", self.inner.ranks()),
            ));
        }
        Ok(())
    }
}

#[pymethods]
impl CpLayoutPy {
    /// The layout of `cu_seqlens` (the packed sequence's document boundaries) over `ranks`.
    #[new]
    fn new(cu_seqlens: Vec<i32>, ranks: usize) -> PyResult<Self> {
        let inner = CpLayout::new(&cu_seqlens, ranks).map_err(error::runtime)?;
        Ok(CpLayoutPy { inner })
    }

    /// Ranks of the group.
    #[getter]
    fn ranks(&self) -> usize {
        self.inner.ranks()
    }

    /// `W`, the aligned workspace rows of the whole sequence.
    #[getter]
    fn workspace_rows(&self) -> usize {
        self.inner.workspace_rows()
    }

    /// `S`, the aligned K/V rows each rank holds.
    #[getter]
    fn slice_rows(&self) -> usize {
        self.inner.slice_rows()
    }

    /// `R·S`, the rows of the gathered K/V.
    #[getter]
    fn gathered_rows(&self) -> usize {
        self.inner.gathered_rows()
    }

    /// The document boundaries.
    #[getter]
    fn cu_seqlens(&self) -> Vec<i32> {
        self.inner.cu_seqlens().to_vec()
    }

    /// `(start, end)`: the compact tokens of rank `rank`.
    fn token_rows(&self, rank: usize) -> PyResult<(usize, usize)> {
        self.check_rank(rank)?;
        let r = self.inner.token_rows(rank);
        Ok((r.start, r.end))
    }

    /// `(start, end)`: the aligned rows of rank `rank`'s K/V slice that hold its tokens.
    fn block_rows(&self, rank: usize) -> PyResult<(usize, usize)> {
        self.check_rank(rank)?;
        let r = self.inner.block_rows(rank);
        Ok((r.start, r.end))
    }

    /// The boundaries of the documents' pieces that rank `rank` holds.
    fn local_cu_seqlens(&self, rank: usize) -> PyResult<Vec<i32>> {
        self.check_rank(rank)?;
        Ok(self.inner.local_cu_seqlens(rank))
    }

    /// Rank `rank`'s schedule from its rows of the selection, `q2k_local [4, T_r, 16]` (a
    /// contiguous CPU int32 tensor), validated on the host.
    fn local_schedule(&self, rank: usize, q2k_local: &Bound<'_, PyAny>) -> PyResult<HostSchedule> {
        self.check_rank(rank)?;
        let q2k = local_q2k(&self.inner, rank, &Tensor::read("q2k_local", q2k_local)?)?;
        let inner = self
            .inner
            .local_schedule(rank, &q2k, msa_runtime::forward::QUERIES_PER_WORK)
            .map_err(error::schedule)?;
        Ok(HostSchedule { inner })
    }
}

/// The rank's selection rows, read from a CPU int32 `[4, T_r, 16]` tensor.
fn local_q2k(layout: &CpLayout, rank: usize, x: &Tensor) -> PyResult<Vec<i32>> {
    let (shape, text) = q2k_shape(layout, rank);
    x.expect_dtype(Dtype::I32)?;
    x.expect_shape(&shape, &text)?;
    x.host_i32()
}

/// The shape of rank `rank`'s rows of the selection, `[4, T_r, 16]`, and its description.
fn q2k_shape(layout: &CpLayout, rank: usize) -> (Vec<usize>, String) {
    let t = layout.token_rows(rank).len();
    (
        vec![NUM_INDEX_HEADS, t, TOPK_BLOCKS],
        format!("[4, T_r, 16] with T_r = {t} (rank {rank}'s tokens)"),
    )
}

/// A rank's schedule built on the device (`msa_runtime::RankSchedule`), from a CUDA
/// `q2k_local`: no host copy, no sync. A bad selection is flagged on the device; `check()`
/// reports it.
#[pyclass(module = "msa_ptx._native", name = "CPRankSchedule", frozen)]
pub struct CpRankSchedulePy {
    inner: Mutex<RankSchedule<CudaBackend>>,
    device: usize,
    rank: usize,
    // The stream the schedule's memory is freed on; kept with it.
    stream: CudaStreamHandle,
}

#[pymethods]
impl CpRankSchedulePy {
    /// Waits for the build and raises `ValueError` naming the first fault of a flagged
    /// selection (whose rank then contributes nothing: zero gradients on its queries, and no
    /// share in any rank's dK/dV).
    fn check(&self, py: Python<'_>) -> PyResult<()> {
        py.detach(|| -> Result<(), RuntimeError> {
            let mut backend = CudaBackend::new(&self.stream.0)?;
            let s = self.inner.lock().unwrap_or_else(|e| e.into_inner());
            s.status(&mut backend)
        })
        .map_err(error::runtime)
    }

    /// The rank it was built for.
    #[getter]
    fn rank(&self) -> usize {
        self.rank
    }
}

/// A rank's collectives as two Python callables: `gather(send_ptr, send_bytes, recv_ptr)`
/// all-gathers bytes, `reduce_scatter(ptr, len)` reduce-scatters `len` f32 in place.
struct PyCollective {
    rank: usize,
    ranks: usize,
    gather: Py<PyAny>,
    reduce_scatter: Option<Py<PyAny>>,
}

/// Calls `f(args)` with the GIL; a Python exception becomes [`RuntimeError::Collective`].
fn call_back<A>(f: &Py<PyAny>, call: &'static str, args: A) -> Result<(), RuntimeError>
where
    A: for<'py> pyo3::call::PyCallArgs<'py>,
{
    Python::attach(|py| {
        f.call1(py, args)
            .map(|_| ())
            .map_err(|e| RuntimeError::Collective {
                call,
                message: e.to_string(),
            })
    })
}

impl Collective<CudaBackend> for PyCollective {
    fn ranks(&self) -> usize {
        self.ranks
    }

    fn rank(&self) -> usize {
        self.rank
    }

    fn all_gather_bf16(
        &mut self,
        _backend: &mut CudaBackend,
        send: Span<bf16>,
        recv: Span<bf16>,
    ) -> Result<(), RuntimeError> {
        let bytes = send.len * std::mem::size_of::<bf16>();
        call_back(
            &self.gather,
            "torch.distributed.all_gather_into_tensor",
            (send.addr, bytes, recv.addr),
        )
    }

    fn reduce_scatter_f32_in_place(
        &mut self,
        _backend: &mut CudaBackend,
        buf: Span<f32>,
    ) -> Result<(), RuntimeError> {
        let f = self
            .reduce_scatter
            .as_ref()
            .ok_or(RuntimeError::Collective {
                call: "reduce_scatter",
                message: "the forward has no reduction".into(),
            })?;
        call_back(
            f,
            "torch.distributed.reduce_scatter_tensor",
            (buf.addr, buf.len),
        )
    }
}

/// The backward's rank state (its workspaces) per `(device, stream)`.
fn backward_cache() -> &'static Cache<CpBackward<CudaBackend>> {
    static CACHE: OnceLock<Cache<CpBackward<CudaBackend>>> = OnceLock::new();
    CACHE.get_or_init(Default::default)
}

/// The forward's rank state (the gathered K/V) per `(device, stream)`.
fn forward_cache() -> &'static Cache<CpForward<CudaBackend>> {
    static CACHE: OnceLock<Cache<CpForward<CudaBackend>>> = OnceLock::new();
    CACHE.get_or_init(Default::default)
}

/// Reads and checks a rank's tensors: `(name, dtype, shape, shape text)` each, all on one
/// CUDA device, dense and 16-byte aligned; returns them and the device.
fn read_all(
    specs: &[(&'static str, Dtype, Vec<usize>, String)],
    objs: &[&Bound<'_, PyAny>],
) -> PyResult<(Vec<Tensor>, usize)> {
    let mut tensors = Vec::with_capacity(objs.len());
    for ((name, dtype, shape, text), obj) in specs.iter().zip(objs) {
        let x = Tensor::read(name, obj)?;
        x.expect_dtype(*dtype)?;
        x.expect_shape(shape, text)?;
        tensors.push(x);
    }
    let device = common_device(&tensors.iter().collect::<Vec<_>>())?;
    for x in &tensors {
        x.expect_dense(16)?;
    }
    Ok((tensors, device))
}

/// The shapes of rank `rank`'s query-side and K/V tensors.
fn shapes(layout: &CpLayout, rank: usize) -> (Vec<usize>, Vec<usize>, Vec<usize>, String, String) {
    let t = layout.token_rows(rank).len();
    let s = layout.slice_rows();
    (
        vec![t, NUM_Q_HEADS, HEAD_DIM],
        vec![t, NUM_Q_HEADS],
        vec![s, NUM_KV_HEADS, HEAD_DIM],
        format!("[T_r, 64, 128] / [T_r, 64] with T_r = {t} (rank {rank}'s tokens)"),
        format!("[S, 4, 128] with S = {s} (the layout's slice rows)"),
    )
}

/// Rank `rank`'s forward on `stream`: reads `q [T_r, 64, 128]`, its K/V slices `[S, 4, 128]`
/// and `q2k_local [4, T_r, 16]` int32, writes `out` and `lse` in place; all-gathers K/V
/// through `gather`. Returns the rank's schedule, which `cp_backward` takes: validated on the
/// host for a CPU `q2k_local` (`HostSchedule`), built on the device for a CUDA one
/// (`CPRankSchedule`, no host copy or sync).
#[pyfunction]
#[pyo3(signature = (layout, rank, q, k_slice, v_slice, q2k_local, out, lse, stream, gather))]
#[allow(clippy::too_many_arguments)] // a rank's tensors, its stream and its collective
pub fn cp_forward(
    py: Python<'_>,
    layout: &CpLayoutPy,
    rank: usize,
    q: &Bound<'_, PyAny>,
    k_slice: &Bound<'_, PyAny>,
    v_slice: &Bound<'_, PyAny>,
    q2k_local: &Bound<'_, PyAny>,
    out: &Bound<'_, PyAny>,
    lse: &Bound<'_, PyAny>,
    stream: u64,
    gather: Py<PyAny>,
) -> PyResult<Py<PyAny>> {
    layout.check_rank(rank)?;
    let l = &layout.inner;
    let x = Tensor::read("q2k_local", q2k_local)?;
    let on_device = !x.is_cpu();
    let q2k = if on_device {
        Vec::new()
    } else {
        local_q2k(l, rank, &x)?
    };
    let (qs, ls, kvs, qt, kvt) = shapes(l, rank);
    let specs = [
        ("q", Dtype::Bf16, qs.clone(), qt.clone()),
        ("k_slice", Dtype::Bf16, kvs.clone(), kvt.clone()),
        ("v_slice", Dtype::Bf16, kvs, kvt),
        ("out", Dtype::Bf16, qs, qt.clone()),
        ("lse", Dtype::F32, ls, qt),
    ];
    let (x, device) = if on_device {
        let (shape, text) = q2k_shape(l, rank);
        let mut specs = specs.to_vec();
        specs.push(("q2k_local", Dtype::I32, shape, text));
        read_all(&specs, &[q, k_slice, v_slice, out, lse, q2k_local])?
    } else {
        read_all(&specs, &[q, k_slice, v_slice, out, lse])?
    };
    let io = CpForwardBuffers {
        q: x[0].span(),
        k_slice: x[1].span(),
        v_slice: x[2].span(),
        out: x[3].span(),
        lse: x[4].span(),
    };
    let mut comm = PyCollective {
        rank,
        ranks: l.ranks(),
        gather,
        reduce_scatter: None,
    };
    if on_device {
        let q2k_span = x[5].span();
        let rs = py
            .detach(|| -> Result<_, RuntimeError> {
                let handle: CudaStreamHandle = cuda_stream(device, stream)?;
                let mut backend = CudaBackend::new(&handle.0)?;
                let state = entry(forward_cache(), (device, stream));
                let mut forward = state.lock().unwrap_or_else(|e| e.into_inner());
                let mut rs = RankSchedule::new(&mut backend, l, rank)?;
                forward.run_on_device(&mut backend, &mut comm, l, &io, q2k_span, &mut rs)?;
                Ok(CpRankSchedulePy {
                    inner: Mutex::new(rs),
                    device,
                    rank,
                    stream: handle,
                })
            })
            .map_err(error::runtime)?;
        return Ok(Py::new(py, rs)?.into_any());
    }
    let inner = py
        .detach(|| -> Result<_, RuntimeError> {
            let handle: CudaStreamHandle = cuda_stream(device, stream)?;
            let mut backend = CudaBackend::new(&handle.0)?;
            let state = entry(forward_cache(), (device, stream));
            let mut forward = state.lock().unwrap_or_else(|e| e.into_inner());
            forward.run_on(&mut backend, &mut comm, l, &io, &q2k)
        })
        .map_err(error::runtime)?;
    Ok(Py::new(py, HostSchedule { inner })?.into_any())
}

/// Rank `rank`'s backward on `stream` with its schedule (`cp_forward`'s, either kind, or
/// `CPLayout.local_schedule`): reads `q`, `grad_out`, `out [T_r, 64, 128]`, `lse [T_r, 64]`
/// and its K/V slices `[S, 4, 128]`, writes `dq` and the K/V slices' `dk_slice`/`dv_slice` in
/// place (summed over every rank's queries); all-gathers K/V through `gather` and
/// reduce-scatters the fp32 dK/dV through `reduce_scatter`.
#[pyfunction]
#[pyo3(signature = (layout, rank, q, k_slice, v_slice, grad_out, lse, out, dq, dk_slice, dv_slice, schedule, stream, gather, reduce_scatter))]
#[allow(clippy::too_many_arguments)] // a rank's tensors, its schedule, stream and collectives
pub fn cp_backward(
    py: Python<'_>,
    layout: &CpLayoutPy,
    rank: usize,
    q: &Bound<'_, PyAny>,
    k_slice: &Bound<'_, PyAny>,
    v_slice: &Bound<'_, PyAny>,
    grad_out: &Bound<'_, PyAny>,
    lse: &Bound<'_, PyAny>,
    out: &Bound<'_, PyAny>,
    dq: &Bound<'_, PyAny>,
    dk_slice: &Bound<'_, PyAny>,
    dv_slice: &Bound<'_, PyAny>,
    schedule: &Bound<'_, PyAny>,
    stream: u64,
    gather: Py<PyAny>,
    reduce_scatter: Py<PyAny>,
) -> PyResult<()> {
    layout.check_rank(rank)?;
    let host = schedule.cast::<HostSchedule>().ok();
    let resident = schedule.cast::<CpRankSchedulePy>().ok();
    if host.is_none() && resident.is_none() {
        return Err(error::type_error(
            "schedule",
            "another object",
            "a rank's schedule (cp_forward's, or CPLayout.local_schedule's)",
        ));
    }
    let l = &layout.inner;
    let (qs, ls, kvs, qt, kvt) = shapes(l, rank);
    let specs = [
        ("q", Dtype::Bf16, qs.clone(), qt.clone()),
        ("k_slice", Dtype::Bf16, kvs.clone(), kvt.clone()),
        ("v_slice", Dtype::Bf16, kvs.clone(), kvt.clone()),
        ("grad_out", Dtype::Bf16, qs.clone(), qt.clone()),
        ("lse", Dtype::F32, ls, qt.clone()),
        ("out", Dtype::Bf16, qs.clone(), qt.clone()),
        ("dq", Dtype::Bf16, qs, qt),
        ("dk_slice", Dtype::Bf16, kvs.clone(), kvt.clone()),
        ("dv_slice", Dtype::Bf16, kvs, kvt),
    ];
    let objs = [
        q, k_slice, v_slice, grad_out, lse, out, dq, dk_slice, dv_slice,
    ];
    let (x, device) = read_all(&specs, &objs)?;
    if let Some(r) = &resident {
        if r.get().device != device {
            return Err(error::value_error(
                "schedule",
                format!("a schedule built on cuda:{}", r.get().device),
                &format!("one built on the tensors' device, cuda:{device}"),
            ));
        }
    }
    let io = CpBuffers {
        q: x[0].span(),
        k_slice: x[1].span(),
        v_slice: x[2].span(),
        grad_out: x[3].span(),
        lse: x[4].span(),
        out: x[5].span(),
        dq: x[6].span(),
        dk_slice: x[7].span(),
        dv_slice: x[8].span(),
    };
    let mut comm = PyCollective {
        rank,
        ranks: l.ranks(),
        gather,
        reduce_scatter: Some(reduce_scatter),
    };
    let (host, resident) = (
        host.as_ref().map(|h| h.get()),
        resident.as_ref().map(|r| r.get()),
    );
    py.detach(|| -> Result<(), RuntimeError> {
        let handle: CudaStreamHandle = cuda_stream(device, stream)?;
        let mut backend = CudaBackend::new(&handle.0)?;
        let state = entry(backward_cache(), (device, stream));
        let mut backward = state.lock().unwrap_or_else(|e| e.into_inner());
        match (host, resident) {
            (Some(h), _) => backward.run_on(&mut backend, &mut comm, l, &io, &h.inner),
            (None, Some(r)) => {
                let rs = r.inner.lock().unwrap_or_else(|e| e.into_inner());
                backward.run_on(&mut backend, &mut comm, l, &io, &*rs)
            }
            (None, None) => unreachable!("checked above"),
        }
    })
    .map_err(error::runtime)
}

/// The group's verdict on the last `cp_backward` on `(device, stream)`
/// (`CpBackward::status`): `None` when no rank's device schedule was flagged. Synchronizes
/// the stream.
///
/// # Errors
/// `ValueError` naming every flagged rank (their queries are missing from every rank's
/// dK/dV), or when the last `cp_backward` on this stream failed before its gathers;
/// `RuntimeError` when none ran on it.
#[pyfunction]
pub fn cp_backward_status(py: Python<'_>, device: usize, stream: u64) -> PyResult<()> {
    let state = {
        let map = backward_cache().lock().unwrap_or_else(|e| e.into_inner());
        map.get(&(device, stream)).cloned()
    };
    let Some(state) = state else {
        return Err(pyo3::exceptions::PyRuntimeError::new_err(format!(
            "cp_backward_status: no cp_backward ran on cuda:{device}, stream {stream:#x}"
        )));
    };
    py.detach(|| -> Result<(), RuntimeError> {
        let handle: CudaStreamHandle = cuda_stream(device, stream)?;
        let mut backend = CudaBackend::new(&handle.0)?;
        let backward = state.lock().unwrap_or_else(|e| e.into_inner());
        backward.status(&mut backend)
    })
    .map_err(error::runtime)
}

/// Drops every cached context-parallel state (freed stream-ordered on its stream).
#[pyfunction]
pub fn clear_cp_cache() {
    backward_cache()
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .clear();
    forward_cache()
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .clear();
}

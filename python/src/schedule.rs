//! The schedule a backward runs on, in its two forms: a validated host `Schedule`
//! (`HostSchedule`) and one built on the device from a CUDA `q2k` (`ResidentSchedule`), plus
//! the shape and dtype checks of the original `MSABackwardSchedule.__post_init__`.

use crate::error;
use crate::tensor::{Dtype, Tensor};
use crate::{cuda_stream, CudaStreamHandle};
use msa_runtime::schedule_build::StatusReadback;
use msa_runtime::{
    build_schedule, max_workspace_rows, CudaBackend, ResidentSchedule, Schedule,
    ScheduleBuildSizes, NUM_INDEX_HEADS, TOPK_BLOCKS,
};
use pyo3::prelude::*;
use pyo3::types::PyBytes;
use std::sync::Mutex;

/// The names of the six fields, in the original constructor's order.
const FIELDS: [&str; 6] = [
    "row_ptr",
    "q_indices",
    "scheduler_metadata",
    "work_count",
    "cu_seqlens",
    "document_workspace_starts",
];

/// One field of a schedule: its name, shape and either its bytes (host) or its device address.
type Field<T> = (&'static str, Vec<usize>, T);

/// The checks of the original `MSABackwardSchedule.__post_init__`: every field int32
/// (`TypeError`), shaped `row_ptr [4, rows+1]`, `q_indices [4, edge_capacity]`,
/// `scheduler_metadata [work_capacity, 6]`, `work_count [1]`, `cu_seqlens [documents+1]`,
/// `document_workspace_starts [documents]`, and all on one device (`ValueError`).
#[pyfunction]
pub fn check_schedule_fields(
    row_ptr: &Bound<'_, PyAny>,
    q_indices: &Bound<'_, PyAny>,
    scheduler_metadata: &Bound<'_, PyAny>,
    work_count: &Bound<'_, PyAny>,
    cu_seqlens: &Bound<'_, PyAny>,
    document_workspace_starts: &Bound<'_, PyAny>,
) -> PyResult<()> {
    let objs = [
        row_ptr,
        q_indices,
        scheduler_metadata,
        work_count,
        cu_seqlens,
        document_workspace_starts,
    ];
    let mut fields = Vec::with_capacity(6);
    for (name, obj) in FIELDS.iter().zip(objs) {
        let t = Tensor::read(name, obj)?;
        t.expect_dtype(Dtype::I32)?;
        fields.push(t);
    }
    let shape = |t: &Tensor, ok: bool, text: &str| -> PyResult<()> {
        if ok {
            Ok(())
        } else {
            Err(error::value_error(
                t.name,
                format!("shape {:?}", t.shape),
                text,
            ))
        }
    };
    let dims = |t: &Tensor| t.shape.clone();
    let [rp, qi, sm, wc, cu, ws] = [0, 1, 2, 3, 4, 5].map(|i| &fields[i]);
    shape(
        rp,
        matches!(dims(rp)[..], [4, n] if n >= 2),
        "[4, rows + 1] with rows >= 1",
    )?;
    shape(
        qi,
        matches!(dims(qi)[..], [4, n] if n >= 1),
        "[4, edge_capacity] with edge_capacity >= 1",
    )?;
    shape(
        sm,
        matches!(dims(sm)[..], [n, 6] if n >= 1),
        "[work_capacity, 6] with work_capacity >= 1",
    )?;
    shape(wc, dims(wc) == [1], "[1]")?;
    shape(
        cu,
        matches!(dims(cu)[..], [n] if n >= 2),
        "[documents + 1] with documents >= 1",
    )?;
    let docs = cu.shape[0] - 1;
    shape(
        ws,
        dims(ws) == [docs],
        &format!(
            "[documents] = [{docs}] (cu_seqlens has {} entries)",
            docs + 1
        ),
    )?;
    let device = |t: &Tensor| (t.is_cpu(), t.cuda_index().ok());
    if let Some(t) = fields.iter().find(|t| device(t) != device(rp)) {
        return Err(error::value_error(
            t.name,
            "a tensor on another device than `row_ptr`",
            "every field on one device",
        ));
    }
    Ok(())
}

/// A schedule validated on the host (`msa_runtime::Schedule`): every value check of the
/// contract has passed. The backward uploads it on each call (stream-ordered).
#[pyclass(module = "msa_ptx._native", frozen)]
pub struct HostSchedule {
    pub(crate) inner: Schedule,
}

#[pymethods]
impl HostSchedule {
    /// Validates the six fields (contiguous CPU int32 tensors) against the whole contract.
    #[staticmethod]
    fn from_fields(
        row_ptr: &Bound<'_, PyAny>,
        q_indices: &Bound<'_, PyAny>,
        scheduler_metadata: &Bound<'_, PyAny>,
        work_count: &Bound<'_, PyAny>,
        cu_seqlens: &Bound<'_, PyAny>,
        document_workspace_starts: &Bound<'_, PyAny>,
    ) -> PyResult<HostSchedule> {
        check_schedule_fields(
            row_ptr,
            q_indices,
            scheduler_metadata,
            work_count,
            cu_seqlens,
            document_workspace_starts,
        )?;
        let read = |name: &'static str, obj: &Bound<'_, PyAny>| Tensor::read(name, obj)?.host_i32();
        let inner = Schedule::new(
            read("row_ptr", row_ptr)?,
            read("q_indices", q_indices)?,
            read("scheduler_metadata", scheduler_metadata)?,
            read("work_count", work_count)?[0],
            read("cu_seqlens", cu_seqlens)?,
            read("document_workspace_starts", document_workspace_starts)?,
        )
        .map_err(error::schedule)?;
        Ok(HostSchedule { inner })
    }

    /// `msa_runtime::build_schedule` from CPU int32 `q2k [4, T, 16]` and `cu_seqlens [D+1]`.
    #[staticmethod]
    #[pyo3(signature = (q2k, cu_seqlens, queries_per_work = 64))]
    fn build(
        q2k: &Bound<'_, PyAny>,
        cu_seqlens: &Bound<'_, PyAny>,
        queries_per_work: usize,
    ) -> PyResult<HostSchedule> {
        let (q2k, cu) = (
            Tensor::read("q2k", q2k)?,
            Tensor::read("cu_seqlens", cu_seqlens)?,
        );
        q2k.expect_dtype(Dtype::I32)?;
        cu.expect_dtype(Dtype::I32)?;
        check_q2k_shape(&q2k)?;
        let inner = build_schedule(&q2k.host_i32()?, &cu.host_i32()?, queries_per_work)
            .map_err(error::schedule)?;
        Ok(HostSchedule { inner })
    }

    /// Tokens `T`.
    #[getter]
    fn num_tokens(&self) -> usize {
        self.inner.num_tokens()
    }

    /// Rows `W` of the aligned K/V layout.
    #[getter]
    fn workspace_rows(&self) -> usize {
        self.inner.workspace_rows()
    }

    /// Documents.
    #[getter]
    fn num_documents(&self) -> usize {
        self.inner.num_documents()
    }

    /// The six fields as `(name, shape, bytes)`, little-endian int32, in constructor order.
    fn fields<'py>(&self, py: Python<'py>) -> Vec<Field<Bound<'py, PyBytes>>> {
        let s = &self.inner;
        let bytes = |v: &[i32]| {
            let raw: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
            PyBytes::new(py, &raw)
        };
        vec![
            (
                "row_ptr",
                vec![NUM_INDEX_HEADS, s.rows() + 1],
                bytes(s.row_ptr()),
            ),
            (
                "q_indices",
                vec![NUM_INDEX_HEADS, s.edge_capacity()],
                bytes(s.q_indices()),
            ),
            (
                "scheduler_metadata",
                vec![s.work_capacity(), 6],
                bytes(s.scheduler_metadata()),
            ),
            ("work_count", vec![1], bytes(&[s.work_count()])),
            (
                "cu_seqlens",
                vec![s.num_documents() + 1],
                bytes(s.cu_seqlens()),
            ),
            (
                "document_workspace_starts",
                vec![s.num_documents()],
                bytes(s.document_workspace_starts()),
            ),
        ]
    }
}

fn check_q2k_shape(q2k: &Tensor) -> PyResult<usize> {
    match q2k.shape[..] {
        [NUM_INDEX_HEADS, t, TOPK_BLOCKS] if t >= 1 => Ok(t),
        _ => Err(error::value_error(
            "q2k",
            format!("shape {:?}", q2k.shape),
            "[4, T, 16] with T >= 1",
        )),
    }
}

/// A schedule built on a CUDA device from a device `q2k` (`msa_runtime::ResidentSchedule`):
/// no copy to the host and no host sync. Faults in the values are flagged on the device;
/// `poll` and `check` report them.
#[pyclass(module = "msa_ptx._native", name = "ResidentSchedule", frozen)]
pub struct ResidentSchedulePy {
    pub(crate) inner: Mutex<ResidentSchedule<CudaBackend>>,
    pub(crate) device: usize,
    pub(crate) sizes: ScheduleBuildSizes,
    status: Mutex<StatusReadback>,
    // The stream the schedule's memory is freed on; kept with it.
    _stream: CudaStreamHandle,
}

#[pymethods]
impl ResidentSchedulePy {
    /// Sizes the schedule from the shapes (`W` defaults to `max_workspace_rows(T, D)`),
    /// allocates it and issues the five build launches on `stream` (a `CUstream` handle of
    /// device `q2k.device`), followed by a non-blocking copy of the build's verdict.
    #[staticmethod]
    #[pyo3(signature = (q2k, cu_seqlens, stream, workspace_rows = None, queries_per_work = 64))]
    fn build(
        py: Python<'_>,
        q2k: &Bound<'_, PyAny>,
        cu_seqlens: &Bound<'_, PyAny>,
        stream: u64,
        workspace_rows: Option<usize>,
        queries_per_work: usize,
    ) -> PyResult<ResidentSchedulePy> {
        let (q2k, cu) = (
            Tensor::read("q2k", q2k)?,
            Tensor::read("cu_seqlens", cu_seqlens)?,
        );
        q2k.expect_dtype(Dtype::I32)?;
        cu.expect_dtype(Dtype::I32)?;
        let t = check_q2k_shape(&q2k)?;
        let docs = match cu.shape[..] {
            [n] if n >= 2 => n - 1,
            _ => {
                return Err(error::value_error(
                    "cu_seqlens",
                    format!("shape {:?}", cu.shape),
                    "[documents + 1] with documents >= 1",
                ))
            }
        };
        let device = crate::tensor::common_device(&[&q2k, &cu])?;
        q2k.expect_dense(16)?;
        cu.expect_dense(4)?;
        let w = workspace_rows.unwrap_or_else(|| max_workspace_rows(t, docs));
        let sizes =
            ScheduleBuildSizes::new(t, docs, w, queries_per_work).map_err(error::runtime)?;
        let (q2k_span, cu_span) = (q2k.span(), cu.span());
        py.detach(|| {
            let stream = cuda_stream(device, stream)?;
            let mut backend = CudaBackend::new(&stream.0)?;
            let mut schedule = ResidentSchedule::new(&mut backend, sizes)?;
            schedule.build(&mut backend, q2k_span, cu_span)?;
            let status = schedule.read_status(&backend)?;
            Ok(ResidentSchedulePy {
                inner: Mutex::new(schedule),
                device,
                sizes,
                status: Mutex::new(status),
                _stream: stream,
            })
        })
        .map_err(error::runtime)
    }

    /// Tokens `T`.
    #[getter]
    fn num_tokens(&self) -> usize {
        self.sizes.num_tokens
    }

    /// Rows `W` of the aligned K/V buffers the schedule was sized for.
    #[getter]
    fn workspace_rows(&self) -> usize {
        self.sizes.workspace_rows
    }

    /// Documents.
    #[getter]
    fn num_documents(&self) -> usize {
        self.sizes.num_documents
    }

    /// The CUDA device index.
    #[getter]
    fn device(&self) -> usize {
        self.device
    }

    /// The six fields as `(name, shape, device address)` of int32 arrays, in constructor
    /// order; `row_ptr` has the capacity `R + 1` columns (trailing rows empty) and
    /// `scheduler_metadata` the capacity rows (rows past `work_count` zero).
    fn fields(&self) -> Vec<Field<u64>> {
        let r = self.inner.lock().unwrap_or_else(|e| e.into_inner()).refs();
        vec![
            ("row_ptr", vec![NUM_INDEX_HEADS, r.rows + 1], r.row_ptr),
            (
                "q_indices",
                vec![NUM_INDEX_HEADS, r.edge_capacity],
                r.q_indices,
            ),
            ("scheduler_metadata", vec![r.work_capacity, 6], r.metadata),
            ("work_count", vec![1], r.work_count),
            ("cu_seqlens", vec![r.num_docs + 1], r.cu_seqlens),
            ("document_workspace_starts", vec![r.num_docs], r.ws_starts),
        ]
    }

    /// The build's verdict if it has reached the host: `None` while pending, `True` for a
    /// valid input; a flagged input raises `ValueError` naming the first fault as
    /// `build_schedule` would. Never blocks.
    fn poll(&self) -> PyResult<Option<bool>> {
        let status = self.status.lock().unwrap_or_else(|e| e.into_inner());
        match status.poll() {
            None => Ok(None),
            Some(r) => r.map(|()| Some(true)).map_err(error::runtime),
        }
    }

    /// Blocks until the verdict is on the host; raises `ValueError` for a flagged input.
    fn check(&self, py: Python<'_>) -> PyResult<()> {
        py.detach(|| {
            let status = self.status.lock().unwrap_or_else(|e| e.into_inner());
            status.wait()
        })
        .map_err(error::runtime)
    }
}

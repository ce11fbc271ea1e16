//! `run_backward` on torch tensors: the checks, then `MsaBackward::run_on` on the caller's
//! CUDA stream with the tensors' own memory (zero-copy), and a workspace cached per
//! `(device, stream)`.

use crate::error;
use crate::schedule::{HostSchedule, ResidentSchedulePy};
use crate::tensor::{common_device, Dtype, Tensor};
use crate::{cuda_stream, CudaStreamHandle};
use msa_runtime::{
    BackwardBuffers, CudaBackend, MsaBackward, RuntimeError, HEAD_DIM, NUM_INDEX_HEADS,
    NUM_KV_HEADS, NUM_Q_HEADS, TOPK_BLOCKS,
};
use pyo3::prelude::*;
use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

/// The schedule argument: a host schedule or one resident on the device.
pub(crate) enum Sched<'a> {
    Host(&'a HostSchedule),
    Resident(&'a ResidentSchedulePy),
}

impl<'a> Sched<'a> {
    pub(crate) fn of(obj: &'a Bound<'_, PyAny>) -> PyResult<Sched<'a>> {
        if let Ok(h) = obj.cast::<HostSchedule>() {
            return Ok(Sched::Host(h.get()));
        }
        if let Ok(r) = obj.cast::<ResidentSchedulePy>() {
            return Ok(Sched::Resident(r.get()));
        }
        Err(error::type_error(
            "schedule",
            "another object",
            "a validated schedule (msa_ptx.MSABackwardSchedule)",
        ))
    }

    /// `(T, W)`.
    fn shape(&self) -> (usize, usize) {
        match self {
            Sched::Host(h) => (h.inner.num_tokens(), h.inner.workspace_rows()),
            Sched::Resident(r) => (r.sizes.num_tokens, r.sizes.workspace_rows),
        }
    }
}

/// The tensors of one call, read and checked.
pub(crate) struct Args {
    pub(crate) tensors: Vec<Tensor>,
    pub(crate) device: usize,
}

const INPUTS: [&str; 6] = ["q", "k_aligned", "v_aligned", "grad_out", "lse", "out"];
const OUTPUTS: [&str; 3] = ["dq", "dk_aligned", "dv_aligned"];

/// Reads and checks `objs` (the inputs, then possibly the outputs) against the schedule's `T`
/// and `W`: dtypes (`TypeError`), shapes (`ValueError`), then devices (`NotImplementedError`
/// off CUDA, `ValueError` for two devices or a resident schedule of another device).
pub(crate) fn check(
    names: &[&'static str],
    objs: &[&Bound<'_, PyAny>],
    sched: &Sched,
) -> PyResult<Args> {
    let (t, w) = sched.shape();
    let q_text = format!("[T, 64, 128] with T = {t} (the schedule's tokens)");
    let kv_text = format!("[W, 4, 128] with W = {w} (the schedule's workspace rows)");
    let lse_text = format!("[T, 64] with T = {t} (the schedule's tokens)");
    let q2k_text = format!("[4, T, 16] with T = {t} (the schedule's tokens)");
    let mut tensors = Vec::with_capacity(objs.len());
    for (&name, obj) in names.iter().zip(objs) {
        let x = Tensor::read(name, obj)?;
        let (dtype, shape, text) = match name {
            "lse" => (Dtype::F32, vec![t, NUM_Q_HEADS], &lse_text),
            "q2k" => (Dtype::I32, vec![NUM_INDEX_HEADS, t, TOPK_BLOCKS], &q2k_text),
            "k_aligned" | "v_aligned" | "dk_aligned" | "dv_aligned" => {
                (Dtype::Bf16, vec![w, NUM_KV_HEADS, HEAD_DIM], &kv_text)
            }
            _ => (Dtype::Bf16, vec![t, NUM_Q_HEADS, HEAD_DIM], &q_text),
        };
        x.expect_dtype(dtype)?;
        x.expect_shape(&shape, text)?;
        tensors.push(x);
    }
    let device = common_device(&tensors.iter().collect::<Vec<_>>())?;
    if let Sched::Resident(r) = sched {
        if r.device != device {
            return Err(error::value_error(
                "schedule",
                format!("a schedule built on cuda:{}", r.device),
                &format!("one built on the tensors' device, cuda:{device}"),
            ));
        }
    }
    Ok(Args { tensors, device })
}

/// The checks of `run_backward` on its six inputs, before anything is allocated; returns the
/// CUDA device index.
#[pyfunction]
#[allow(clippy::too_many_arguments)] // the original run_backward signature
pub fn check_backward(
    q: &Bound<'_, PyAny>,
    k_aligned: &Bound<'_, PyAny>,
    v_aligned: &Bound<'_, PyAny>,
    grad_out: &Bound<'_, PyAny>,
    lse: &Bound<'_, PyAny>,
    out: &Bound<'_, PyAny>,
    schedule: &Bound<'_, PyAny>,
) -> PyResult<usize> {
    let sched = Sched::of(schedule)?;
    let objs = [q, k_aligned, v_aligned, grad_out, lse, out];
    Ok(check(&INPUTS, &objs, &sched)?.device)
}

/// One cached backward (gradient and task workspaces) per `(device, stream, deterministic)`.
type Cache = Mutex<HashMap<(usize, u64, bool), Arc<Mutex<MsaBackward<CudaBackend>>>>>;

fn cache() -> &'static Cache {
    static CACHE: OnceLock<Cache> = OnceLock::new();
    CACHE.get_or_init(Default::default)
}

/// Runs the backward on `stream` (a `CUstream` handle of the tensors' device), reading the six
/// inputs and writing the three outputs in place, all through their `data_ptr()`; every
/// tensor must be contiguous and 16-byte aligned. Nothing is synchronized. `deterministic`
/// selects the bitwise-reproducible mode (`MsaBackward::set_deterministic`), whose workspace
/// is cached beside the default one.
#[pyfunction]
#[pyo3(signature = (q, k_aligned, v_aligned, grad_out, lse, out, dq, dk_aligned, dv_aligned, schedule, stream, deterministic=false))]
#[allow(clippy::too_many_arguments)] // the original signature plus the outputs and the stream
pub fn run_backward(
    py: Python<'_>,
    q: &Bound<'_, PyAny>,
    k_aligned: &Bound<'_, PyAny>,
    v_aligned: &Bound<'_, PyAny>,
    grad_out: &Bound<'_, PyAny>,
    lse: &Bound<'_, PyAny>,
    out: &Bound<'_, PyAny>,
    dq: &Bound<'_, PyAny>,
    dk_aligned: &Bound<'_, PyAny>,
    dv_aligned: &Bound<'_, PyAny>,
    schedule: &Bound<'_, PyAny>,
    stream: u64,
    deterministic: bool,
) -> PyResult<()> {
    let sched = Sched::of(schedule)?;
    let names: Vec<&'static str> = INPUTS.iter().chain(&OUTPUTS).copied().collect();
    let objs = [
        q, k_aligned, v_aligned, grad_out, lse, out, dq, dk_aligned, dv_aligned,
    ];
    let args = check(&names, &objs, &sched)?;
    for x in &args.tensors {
        x.expect_dense(16)?;
    }
    let x = &args.tensors;
    let io = BackwardBuffers {
        q: x[0].span(),
        k_aligned: x[1].span(),
        v_aligned: x[2].span(),
        grad_out: x[3].span(),
        lse: x[4].span(),
        out: x[5].span(),
        dq: x[6].span(),
        dk_aligned: x[7].span(),
        dv_aligned: x[8].span(),
    };
    let device = args.device;
    py.detach(|| -> Result<(), RuntimeError> {
        let handle: CudaStreamHandle = cuda_stream(device, stream)?;
        let mut backend = CudaBackend::new(&handle.0)?;
        let entry = {
            let mut map = cache().lock().unwrap_or_else(|e| e.into_inner());
            map.entry((device, stream, deterministic))
                .or_insert_with(|| {
                    let mut b = MsaBackward::new();
                    b.set_deterministic(deterministic);
                    Arc::new(Mutex::new(b))
                })
                .clone()
        };
        let mut backward = entry.lock().unwrap_or_else(|e| e.into_inner());
        match sched {
            Sched::Host(h) => backward.run_on(&mut backend, &io, &h.inner),
            Sched::Resident(r) => {
                let s = r.inner.lock().unwrap_or_else(|e| e.into_inner());
                backward.run_on(&mut backend, &io, &*s)
            }
        }
    })
    .map_err(error::runtime)
}

/// One row of `workspace_cache`: `((device, stream), (T, W) if allocated, allocations)`.
type CacheRow = ((usize, u64), Option<(usize, usize)>, usize);

/// `((device, stream), (T, W), allocations)` of each cached workspace, for inspection (a
/// stream that ran both modes has one row per mode, the default one first).
#[pyfunction]
pub fn workspace_cache() -> Vec<CacheRow> {
    let map = cache().lock().unwrap_or_else(|e| e.into_inner());
    let mut rows: Vec<_> = map
        .iter()
        .map(|(k, b)| {
            let b = b.lock().unwrap_or_else(|e| e.into_inner());
            (*k, b.capacity(), b.allocation_count())
        })
        .collect();
    rows.sort();
    rows.into_iter()
        .map(|((d, s, _), cap, n)| ((d, s), cap, n))
        .collect()
}

/// Drops every cached workspace, the backward's and the KV forward's (each freed
/// stream-ordered on its stream). Call it before destroying a stream either ran on.
#[pyfunction]
pub fn clear_workspace_cache() {
    cache().lock().unwrap_or_else(|e| e.into_inner()).clear();
    crate::forward::clear_cache();
}

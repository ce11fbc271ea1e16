//! `run_forward` on torch tensors: the checks, then the forward `algorithm` picks on the
//! caller's CUDA stream with the tensors' own memory, on a schedule built on the device:
//! `MsaForward::run_on` (Q-parallel) or `MsaForwardKv::run_on` (KV-parallel, its workspace
//! cached per `(device, stream)` as the backward's is).

use crate::backward::{check, Sched};
use crate::error;
use crate::schedule::ResidentSchedulePy;
use crate::{cuda_stream, entry, Cache, CudaStreamHandle};
use msa_runtime::forward_kv::MsaForwardKv;
use msa_runtime::{Backend, CudaBackend, ForwardAlgorithm, ForwardBuffers, RuntimeError};
use pyo3::prelude::*;
use std::sync::OnceLock;

/// The KV forward's workspaces, one per `(device, stream)`.
fn cache() -> &'static Cache<MsaForwardKv<CudaBackend>> {
    static CACHE: OnceLock<Cache<MsaForwardKv<CudaBackend>>> = OnceLock::new();
    CACHE.get_or_init(Default::default)
}

/// Drops the KV forward's cached workspaces (each freed stream-ordered on its stream);
/// `clear_workspace_cache` calls it.
pub fn clear_cache() {
    cache().lock().unwrap_or_else(|e| e.into_inner()).clear();
}

/// The `(device, stream)` keys of the KV forward's cached workspaces, sorted.
#[pyfunction]
pub fn forward_workspace_cache() -> Vec<(usize, u64)> {
    let map = cache().lock().unwrap_or_else(|e| e.into_inner());
    let mut keys: Vec<_> = map.keys().copied().collect();
    keys.sort_unstable();
    keys
}

/// The `algorithm` argument: `"auto"`, `"q_parallel"` or `"kv_parallel"`.
fn parse_algorithm(name: &str) -> PyResult<ForwardAlgorithm> {
    match name {
        "auto" => Ok(ForwardAlgorithm::Auto),
        "q_parallel" => Ok(ForwardAlgorithm::QParallel),
        "kv_parallel" => Ok(ForwardAlgorithm::KvParallel),
        other => Err(error::value_error(
            "algorithm",
            format!("{other:?}"),
            "\"auto\", \"q_parallel\" or \"kv_parallel\"",
        )),
    }
}

/// Runs the forward on `stream` (a `CUstream` of the tensors' device): reads `q`,
/// `k_aligned`, `v_aligned` and `q2k`, writes `out [T, 64, 128]` bf16 and `lse [T, 64]` f32 in
/// place, all through their `data_ptr()`. The schedule must be the one built on the device
/// from this `q2k` (`build_schedule` of a CUDA `q2k`); every tensor must be contiguous and
/// 16-byte aligned. Nothing is synchronized.
///
/// `algorithm` (`msa_runtime::ForwardAlgorithm`): `"auto"` takes the KV-parallel forward on
/// capability 9.0 for documents of 4096 tokens or more on average, and the Q-parallel one
/// otherwise, or when `deterministic` asks for a bitwise reproducible forward, or when the
/// KV forward's workspace cannot be allocated; `"q_parallel"` and `"kv_parallel"` force one
/// (the latter only on 9.0, and not with `deterministic`). The KV forward gives a row with a
/// NaN or infinite logit `out = 0` and `lse = NaN`.
#[pyfunction]
#[pyo3(signature = (q, k_aligned, v_aligned, q2k, out, lse, schedule, stream, algorithm = "auto", deterministic = false))]
#[allow(clippy::too_many_arguments)] // the forward's inputs, its two outputs, the stream and the mode
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
    algorithm: &str,
    deterministic: bool,
) -> PyResult<()> {
    let algorithm = parse_algorithm(algorithm)?;
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
    let device = args.device;
    let z = sched.sizes;
    py.detach(|| -> Result<(), RuntimeError> {
        let handle: CudaStreamHandle = cuda_stream(device, stream)?;
        let mut backend = CudaBackend::new(&handle.0)?;
        let shape = (z.num_tokens, z.num_documents, z.workspace_rows);
        let (cc, ordinal) = (backend.capability(), backend.ordinal());
        let kv = algorithm.uses_kv(cc, ordinal, shape, deterministic)?;
        let s = sched.inner.lock().unwrap_or_else(|e| e.into_inner());
        let state = kv.then(|| entry(cache(), (device, stream)));
        let mut forward = state
            .as_ref()
            .map(|st| st.lock().unwrap_or_else(|e| e.into_inner()));
        algorithm.run_on(forward.as_deref_mut(), &mut backend, &io, &s)
    })
    .map_err(error::runtime)
}

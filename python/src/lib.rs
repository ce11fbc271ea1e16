//! `msa_ptx._native`: the PyO3 extension behind the `msa_ptx` Python package (`python/msa_ptx/`).
//!
//! It reads torch tensors through their `data_ptr()` and metadata only (the protocol of
//! `tensor.rs`), checks them, and runs `msa-runtime`'s host flow on the caller's CUDA stream
//! (`torch.cuda.current_stream(device)`, passed as a raw `CUstream` handle): zero-copy, no
//! host sync, outputs written into tensors torch allocated. Errors become the Python classes
//! of `error.rs` with the Rust message. The Python half does what needs torch itself:
//! allocating outputs, copying non-contiguous inputs, finding the current stream.

mod backward;
mod cp;
mod error;
mod forward;
mod schedule;
mod tensor;

use cudarc::driver::{sys, CudaStream};
use msa_runtime::{Device, RuntimeError};
use pyo3::prelude::*;
use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

/// Host-flow state cached per `(device, stream)`: its workspaces, freed stream-ordered on
/// their own stream when the entry is dropped.
pub(crate) type Cache<T> = Mutex<HashMap<(usize, u64), Arc<Mutex<T>>>>;

/// The entry of `key` in `cache`, a fresh `T` the first time.
pub(crate) fn entry<T: Default>(cache: &'static Cache<T>, key: (usize, u64)) -> Arc<Mutex<T>> {
    let mut map = cache.lock().unwrap_or_else(|e| e.into_inner());
    map.entry(key).or_default().clone()
}

/// A CUDA stream owned by torch, wrapped for cudarc without taking ownership.
#[derive(Clone)]
pub(crate) struct CudaStreamHandle(pub(crate) Arc<CudaStream>);

/// The stream `handle` of device `ordinal`, wrapped once per `(device, handle)`.
///
/// torch runs on each device's primary context, which is also the context
/// `msa_runtime::Device::open` retains, so torch's streams and memory are valid there.
pub(crate) fn cuda_stream(ordinal: usize, handle: u64) -> Result<CudaStreamHandle, RuntimeError> {
    type Streams = Mutex<HashMap<(usize, u64), CudaStreamHandle>>;
    static STREAMS: OnceLock<Streams> = OnceLock::new();
    let mut map = STREAMS
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    if let Some(s) = map.get(&(ordinal, handle)) {
        return Ok(s.clone());
    }
    let device = Device::open(ordinal)?;
    // SAFETY: `handle` is `torch.cuda.current_stream(device).cuda_stream` of this device (the
    // Python layer passes nothing else), a stream of its primary context; torch keeps its
    // streams alive for the process (pool and default streams) or as long as the user's
    // `torch.cuda.Stream` lives, which the documentation asks to outlive its cached workspace.
    let stream = unsafe {
        device
            .context()
            .wrap_borrowed_stream(handle as sys::CUstream)
    };
    let s = CudaStreamHandle(stream);
    map.insert((ordinal, handle), s.clone());
    Ok(s)
}

/// `(major, minor, sm_count)` of CUDA device `ordinal`, memoized by the runtime.
#[pyfunction]
fn device_info(py: Python<'_>, ordinal: usize) -> PyResult<(i32, i32, usize)> {
    py.detach(|| {
        let d = Device::open(ordinal)?;
        let (major, minor) = d.capability();
        Ok((major, minor, d.sm_count()))
    })
    .map_err(error::runtime)
}

/// The capabilities `run_backward` has a main kernel for, as `(major, minor)`.
#[pyfunction]
fn supported_capabilities() -> Vec<(i32, i32)> {
    [(9, 0), (10, 0)]
        .into_iter()
        .filter(|&cc| msa_runtime::backward::main_kernel(cc, 0).is_ok())
        .collect()
}

/// Whether the CUDA driver library can be loaded on this machine.
#[pyfunction]
fn driver_present() -> bool {
    msa_runtime::driver_present()
}

/// The CTA walk length for `num_rows` task rows (the original `msa_schedule.rows_per_cta`).
#[pyfunction]
fn rows_per_cta(num_rows: usize) -> usize {
    msa_runtime::rows_per_cta(num_rows)
}

/// `(num_full_ctas, tail_rows, grid_ctas)` of a walk covering every row once
/// (the original `msa_schedule.chunk_map`).
#[pyfunction]
fn chunk_map(num_rows: usize, rows_per_cta: usize, num_sms: usize) -> (usize, usize, usize) {
    msa_runtime::chunk_map(num_rows, rows_per_cta, num_sms)
}

/// The main kernel's grid for any count up to `capacity` (the original
/// `msa_schedule.grid_launch_bound`).
#[pyfunction]
fn grid_launch_bound(capacity: usize, num_sms: usize) -> usize {
    msa_runtime::grid_launch_bound(capacity, num_sms)
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(device_info, m)?)?;
    m.add_function(wrap_pyfunction!(rows_per_cta, m)?)?;
    m.add_function(wrap_pyfunction!(chunk_map, m)?)?;
    m.add_function(wrap_pyfunction!(grid_launch_bound, m)?)?;
    m.add_function(wrap_pyfunction!(supported_capabilities, m)?)?;
    m.add_function(wrap_pyfunction!(driver_present, m)?)?;
    m.add_function(wrap_pyfunction!(schedule::check_schedule_fields, m)?)?;
    m.add_function(wrap_pyfunction!(backward::check_backward, m)?)?;
    m.add_function(wrap_pyfunction!(backward::run_backward, m)?)?;
    m.add_function(wrap_pyfunction!(forward::run_forward, m)?)?;
    m.add_function(wrap_pyfunction!(forward::forward_workspace_cache, m)?)?;
    m.add_function(wrap_pyfunction!(backward::workspace_cache, m)?)?;
    m.add_function(wrap_pyfunction!(backward::clear_workspace_cache, m)?)?;
    m.add_function(wrap_pyfunction!(cp::cp_forward, m)?)?;
    m.add_function(wrap_pyfunction!(cp::cp_backward, m)?)?;
    m.add_function(wrap_pyfunction!(cp::cp_backward_status, m)?)?;
    m.add_function(wrap_pyfunction!(cp::clear_cp_cache, m)?)?;
    m.add_class::<cp::CpLayoutPy>()?;
    m.add_class::<cp::CpRankSchedulePy>()?;
    m.add_class::<schedule::HostSchedule>()?;
    m.add_class::<schedule::ResidentSchedulePy>()?;
    // The contract's constants, from their one home (`msa_runtime::contract`).
    use msa_runtime::contract as c;
    for (name, v) in [
        ("BLOCK_SIZE", c::BLOCK_SIZE),
        ("HEAD_DIM", c::HEAD_DIM),
        ("INDEX_DIM", c::INDEX_DIM),
        ("NUM_Q_HEADS", c::NUM_Q_HEADS),
        ("NUM_KV_HEADS", c::NUM_KV_HEADS),
        ("NUM_INDEX_HEADS", c::NUM_INDEX_HEADS),
        ("MAIN_HEADS_PER_INDEX", c::MAIN_HEADS_PER_INDEX),
        ("TOPK_BLOCKS", c::TOPK_BLOCKS),
        ("QUERY_CHUNK", c::QUERY_CHUNK),
        ("ROWS_PER_CTA_SMALL", c::ROWS_PER_CTA_SMALL),
        ("ROWS_PER_CTA_LARGE", c::ROWS_PER_CTA_LARGE),
        ("ROWS_PER_CTA_SWITCH", c::ROWS_PER_CTA_SWITCH),
        ("MAX_TOKENS", c::MAX_TOKENS),
        ("MAX_BUILD_TOKENS", msa_runtime::MAX_BUILD_TOKENS),
    ] {
        m.add(name, v)?;
    }
    m.add("SOFTMAX_SCALE", c::SOFTMAX_SCALE)?;
    Ok(())
}

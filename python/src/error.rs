//! Rust errors as Python exceptions, with the Rust message.
//!
//! The classes follow the original API: `TypeError` for a wrong dtype or a non-tensor,
//! `ValueError` for a wrong shape or value (the schedule's contract included),
//! `NotImplementedError` for a device the kernels do not run on. Driver, JIT, launch and
//! allocation failures are `RuntimeError`, as torch reports CUDA failures.

use msa_runtime::{RuntimeError, ScheduleError};
use pyo3::exceptions::{PyNotImplementedError, PyRuntimeError, PyTypeError, PyValueError};
use pyo3::PyErr;

/// The Python exception of a runtime error.
pub fn runtime(e: RuntimeError) -> PyErr {
    let msg = e.to_string();
    match e {
        RuntimeError::UnsupportedArch { .. } => PyNotImplementedError::new_err(msg),
        RuntimeError::Input { .. }
        | RuntimeError::NullBuffer { .. }
        | RuntimeError::Overlap { .. }
        | RuntimeError::Schedule(_)
        | RuntimeError::ScheduleFlagged(_)
        | RuntimeError::CpRankFlagged { .. }
        | RuntimeError::TensorMap { .. } => PyValueError::new_err(msg),
        _ => PyRuntimeError::new_err(msg),
    }
}

/// A schedule that breaks the contract: `ValueError`.
pub fn schedule(e: ScheduleError) -> PyErr {
    PyValueError::new_err(e.to_string())
}

/// `argument `name`: found .., expected ..` as a `TypeError`.
pub fn type_error(name: &str, found: impl std::fmt::Display, expected: &str) -> PyErr {
    PyTypeError::new_err(format!(
        "argument `{name}`: found {found}, expected {expected}"
    ))
}

/// `argument `name`: found .., expected ..` as a `ValueError`.
pub fn value_error(name: &str, found: impl std::fmt::Display, expected: &str) -> PyErr {
    PyValueError::new_err(format!(
        "argument `{name}`: found {found}, expected {expected}"
    ))
}

/// `argument `name`: found .., expected ..` as a `NotImplementedError`.
pub fn device_error(name: &str, found: impl std::fmt::Display, expected: &str) -> PyErr {
    PyNotImplementedError::new_err(format!(
        "argument `{name}`: found {found}, expected {expected}"
    ))
}

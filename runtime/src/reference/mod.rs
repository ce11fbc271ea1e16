//! f32 CPU reference of the MSA forward and backward (`docs/design.md` §1.4, §1.5, §3.2, §3.6).
//!
//! Everything here works on compact, row-major `f32` slices holding the values of bf16 data:
//! `q [T,64,128]`, `k`/`v [T,4,128]`, `q2k [4,T,16]` (document-local block ids, `-1` = padding)
//! and `cu_seqlens [docs+1]`. `T` is always `cu_seqlens[docs]`.
//!
//! Compact query row `t` of document `d`, q-head `h` and group `g = h / 16` attends key `s` iff
//! (a) the document-local block `(s - start_d) / 128` is in `q2k[g, t, :]`, (b) `s` lies in `d`
//! and (c) `s <= t`. A row with no kept key has `O = 0`, `LSE = -inf` and zero gradients.
//!
//! Numerics: all arithmetic is f32 (dot products use eight interleaved f32 partial sums, softmax
//! and accumulations are f32; no f64 anywhere). Work runs on all cores, split by kv group and a
//! fixed grid of query chunks; dK/dV partials of the chunks are summed in a fixed order, so
//! results are deterministic and independent of the core count.
//!
//! The module also holds the exact CPU models of the small kernels around the main one
//! ([`preprocess_delta`], [`postprocess`]), the aligned-workspace scatter/gather
//! ([`to_aligned`], [`from_aligned`]) and the tolerance checker every numeric test uses
//! ([`check_close`], `docs/design.md` §4.3).

mod attention;
mod check;
mod layout;
mod rows;
pub mod sampled;
pub mod tasks;

pub use attention::{backward, forward, Forward, Gradients};
pub use check::{
    check_close, ErrorStats, Tolerance, DK_TOLERANCE, DQ_TOLERANCE, DV_TOLERANCE, O_TOLERANCE,
};
pub use layout::{
    deinterleave_dq_pool, from_aligned, interleave_dq_pool, keys_attended, postprocess,
    preprocess_delta, to_aligned,
};

use crate::schedule::ScheduleError;

/// Why the reference rejected its inputs.
///
/// Every variant names the offending field, the value found and what was expected.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ReferenceError {
    /// A slice has the wrong number of elements.
    #[error("`{field}` has {found} elements, expected {expected}")]
    Length {
        /// The argument, e.g. `q`.
        field: &'static str,
        /// The length found.
        found: usize,
        /// The expected length, with the shape it comes from.
        expected: String,
    },
    /// An element holds a value outside its domain.
    #[error("`{field}`: found {found}, expected {expected}")]
    Value {
        /// The element, e.g. `q2k[1, 37, 5]`.
        field: String,
        /// The value found.
        found: String,
        /// What the contract allows.
        expected: String,
    },
    /// `cu_seqlens` does not describe a valid packing.
    #[error(transparent)]
    Schedule(#[from] ScheduleError),
}

use crate::contract::{KV_ROW, Q_ROW};

/// Checks that `field` holds `rows` rows of `row` elements.
fn check_len(
    field: &'static str,
    data_len: usize,
    rows: usize,
    row: usize,
    shape: &str,
) -> Result<(), ReferenceError> {
    // Saturate instead of overflowing: an absurd `cu_seqlens` must give an error, not a panic.
    let expected = rows.saturating_mul(row);
    if data_len == expected {
        Ok(())
    } else {
        Err(ReferenceError::Length {
            field,
            found: data_len,
            expected: format!("{expected} ({shape} with T = {rows})"),
        })
    }
}

/// Validates `cu_seqlens` and returns the token count `T = cu_seqlens[docs]`.
fn num_tokens(cu_seqlens: &[i32]) -> Result<usize, ReferenceError> {
    // workspace_layout checks the shape (>= 2 entries, starts at 0, non-decreasing).
    crate::schedule::workspace_layout(cu_seqlens)?;
    // Non-decreasing from 0, so the last entry is non-negative.
    Ok(cu_seqlens.last().map_or(0, |&t| t as usize))
}

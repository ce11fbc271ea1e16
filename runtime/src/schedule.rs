//! `Schedule`: the forward-derived metadata the backward reads (seed-design §2.1).

use crate::contract::BLOCK_SIZE;

/// Why a schedule, or an input it is built from, was rejected.
///
/// Every variant names the offending field, the value found and what was expected.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ScheduleError {
    /// A field does not satisfy the contract.
    #[error("schedule field `{field}`: found {found}, expected {expected}")]
    Invalid {
        /// The field (with an index where it helps, e.g. `cu_seqlens[3]`).
        field: String,
        /// The value found.
        found: String,
        /// What the contract requires.
        expected: String,
    },
}

impl ScheduleError {
    pub(crate) fn invalid(
        field: impl Into<String>,
        found: impl ToString,
        expected: impl Into<String>,
    ) -> Self {
        ScheduleError::Invalid {
            field: field.into(),
            found: found.to_string(),
            expected: expected.into(),
        }
    }
}

/// The aligned workspace layout of packed documents (seed-design §1.5).
///
/// Returns `document_workspace_starts` (document `d` starts at `Σ_{e<d} ceil(len_e/128)·128`)
/// and the workspace size `W = Σ ceil(len/128)·128`. `cu_seqlens` must start at 0, be
/// non-decreasing and hold at least two entries.
pub fn workspace_layout(cu_seqlens: &[i32]) -> Result<(Vec<i32>, usize), ScheduleError> {
    if cu_seqlens.len() < 2 {
        return Err(ScheduleError::invalid(
            "cu_seqlens.len()",
            cu_seqlens.len(),
            "at least 2 (documents + 1)",
        ));
    }
    if cu_seqlens[0] != 0 {
        return Err(ScheduleError::invalid("cu_seqlens[0]", cu_seqlens[0], "0"));
    }
    let mut starts = Vec::with_capacity(cu_seqlens.len() - 1);
    let mut w: usize = 0;
    for d in 0..cu_seqlens.len() - 1 {
        let len = cu_seqlens[d + 1] - cu_seqlens[d];
        if len < 0 {
            return Err(ScheduleError::invalid(
                format!("cu_seqlens[{}]", d + 1),
                cu_seqlens[d + 1],
                format!(">= cu_seqlens[{d}] = {} (non-decreasing)", cu_seqlens[d]),
            ));
        }
        starts.push(i32::try_from(w).map_err(|_| {
            ScheduleError::invalid("workspace rows", w, "at most i32::MAX")
        })?);
        w += (len as usize).div_ceil(BLOCK_SIZE) * BLOCK_SIZE;
    }
    Ok((starts, w))
}

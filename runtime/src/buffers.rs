//! Host checks on the device buffers a call is given: null and misaligned bases, and outputs
//! that overlap another output or an input. They run before anything is issued, so a bad
//! buffer is a typed error naming it, never a kernel fault after part of the outputs were
//! written, nor a silently wrong gradient.

use crate::backend::{Span, BASE_ALIGN};
use crate::error::RuntimeError;
use std::mem::size_of;

/// One buffer of a call as a device byte range `[start, end)`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Region {
    field: &'static str,
    start: u64,
    end: u64,
    output: bool,
}

impl Region {
    fn new<T>(field: &'static str, span: Span<T>, output: bool) -> Result<Region, RuntimeError> {
        let end = (span.len as u64)
            .checked_mul(size_of::<T>() as u64)
            .and_then(|bytes| span.addr.checked_add(bytes))
            .ok_or_else(|| {
                RuntimeError::input(
                    field,
                    format!("{} elements at {:#x}", span.len, span.addr),
                    "a buffer that ends below 2^64",
                )
            })?;
        Ok(Region {
            field,
            start: span.addr,
            end,
            output,
        })
    }

    /// A buffer the call only reads.
    pub(crate) fn input<T>(field: &'static str, span: Span<T>) -> Result<Region, RuntimeError> {
        Self::new(field, span, false)
    }

    /// A buffer the call writes.
    pub(crate) fn output<T>(field: &'static str, span: Span<T>) -> Result<Region, RuntimeError> {
        Self::new(field, span, true)
    }

    /// Whether the two ranges share a byte (an empty range shares none).
    pub(crate) fn overlaps(&self, other: &Region) -> bool {
        self.start < self.end
            && other.start < other.end
            && self.start < other.end
            && other.start < self.end
    }
}

/// Checks every base is non-null and 16-byte aligned, and that no output overlaps another
/// output or an input. Inputs may overlap each other (they are only read).
///
/// With `in_place`, an output may lie exactly on an input of the same byte size (same base,
/// same end); the caller has made sure that is safe for its launch order, and `opt_in` names
/// how a user asks for it. Partial overlaps are never accepted: they have no use and are
/// almost always a carving mistake.
pub(crate) fn check_regions(
    regions: &[Region],
    in_place: bool,
    opt_in: &'static str,
) -> Result<(), RuntimeError> {
    for r in regions {
        if r.start == 0 {
            return Err(RuntimeError::NullBuffer { field: r.field });
        }
        if !r.start.is_multiple_of(BASE_ALIGN) {
            return Err(RuntimeError::input(
                r.field,
                format!("base address {:#x}", r.start),
                "a 16-byte aligned device address",
            ));
        }
    }
    for (i, a) in regions.iter().enumerate() {
        for b in &regions[i + 1..] {
            if !(a.output || b.output) || !a.overlaps(b) {
                continue;
            }
            let exact = a.start == b.start && a.end == b.end;
            let output_on_input = exact && a.output != b.output;
            if in_place && output_on_input {
                continue;
            }
            return Err(RuntimeError::Overlap {
                first: a.field,
                first_bytes: a.start..a.end,
                second: b.field,
                second_bytes: b.start..b.end,
                allowed: if output_on_input {
                    format!("an output may replace an input of the same size only after {opt_in}")
                } else {
                    "outputs must not overlap each other, nor partly overlap an input".into()
                },
            });
        }
    }
    Ok(())
}

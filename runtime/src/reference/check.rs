//! The tolerance checker of the numeric tests (`docs/design.md` §4.3, `_assert_error`).

use std::fmt;

/// A max-abs / L2-relative tolerance pair.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Tolerance {
    /// Largest allowed `|got − expected|` of any element.
    pub max_abs: f32,
    /// Largest allowed `‖got − expected‖₂ / ‖expected‖₂`.
    pub l2_rel: f32,
}

impl Tolerance {
    /// [`check_close`] with this tolerance.
    ///
    /// # Errors
    /// The failure message of [`check_close`].
    pub fn check(&self, name: &str, got: &[f32], expected: &[f32]) -> Result<ErrorStats, String> {
        check_close(name, got, expected, self.max_abs, self.l2_rel)
    }
}

/// Tolerance of the attention output `O` against the f32 reference (`docs/design.md` §4.3).
pub const O_TOLERANCE: Tolerance = Tolerance {
    max_abs: 0.025,
    l2_rel: 0.006,
};
/// Tolerance of `dQ` (`docs/design.md` §4.3).
pub const DQ_TOLERANCE: Tolerance = Tolerance {
    max_abs: 0.035,
    l2_rel: 0.007,
};
/// Tolerance of `dK` (`docs/design.md` §4.3).
pub const DK_TOLERANCE: Tolerance = Tolerance {
    max_abs: 0.075,
    l2_rel: 0.007,
};
/// Tolerance of `dV` (`docs/design.md` §4.3).
pub const DV_TOLERANCE: Tolerance = Tolerance {
    max_abs: 0.1,
    l2_rel: 0.007,
};

/// Error figures of one comparison, as computed by [`check_close`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ErrorStats {
    /// Number of elements compared.
    pub len: usize,
    /// Largest `|got − expected|` (0 for elements that are equal, including equal infinities).
    pub max_abs: f64,
    /// Flat index of the element with the largest error (0 when nothing differs).
    pub worst_index: usize,
    /// `got` at [`Self::worst_index`].
    pub worst_got: f32,
    /// `expected` at [`Self::worst_index`].
    pub worst_expected: f32,
    /// `‖got − expected‖₂ / ‖expected‖₂`, norms in f64 over the finite elements; `None` when
    /// `‖expected‖₂ = 0`, where a relative error is undefined and only max-abs is judged.
    pub l2_rel: Option<f64>,
}

impl fmt::Display for ErrorStats {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "max-abs {:.3e} at index {} (got {}, expected {}), L2-rel ",
            self.max_abs, self.worst_index, self.worst_got, self.worst_expected
        )?;
        match self.l2_rel {
            Some(r) => write!(f, "{r:.3e}")?,
            None => write!(f, "undefined (expected is all zero)")?,
        }
        write!(f, " over {} elements", self.len)
    }
}

/// Compares `got` with `expected` by max-abs and L2-relative error (`docs/design.md` §4.3).
///
/// Passes iff `max |got − expected| <= max_abs` and `‖got − expected‖ / ‖expected‖ <= l2_rel`
/// (the latter skipped when `‖expected‖ = 0`). Equal values match, including equal infinities
/// (an `LSE` of `-inf`); any other non-finite element (NaN, a lone or opposite infinity) fails.
///
/// # Errors
/// A message naming the tensor, the worst (or first non-finite) flat index, both values and
/// both figures against their tolerances; also for a length mismatch.
pub fn check_close(
    name: &str,
    got: &[f32],
    expected: &[f32],
    max_abs: f32,
    l2_rel: f32,
) -> Result<ErrorStats, String> {
    if got.len() != expected.len() {
        return Err(format!(
            "{name}: length mismatch, got {} elements, expected {}",
            got.len(),
            expected.len()
        ));
    }
    let mut stats = ErrorStats {
        len: got.len(),
        max_abs: 0.0,
        worst_index: 0,
        worst_got: got.first().copied().unwrap_or(0.0),
        worst_expected: expected.first().copied().unwrap_or(0.0),
        l2_rel: None,
    };
    let (mut diff_sq, mut exp_sq) = (0.0f64, 0.0f64);
    for (i, (&a, &e)) in got.iter().zip(expected).enumerate() {
        if a == e {
            if e.is_finite() {
                exp_sq += f64::from(e) * f64::from(e);
            }
            continue;
        }
        if !a.is_finite() || !e.is_finite() {
            return Err(format!(
                "{name}: non-finite mismatch at index {i}: got {a}, expected {e} ({} elements)",
                got.len()
            ));
        }
        let diff = (f64::from(a) - f64::from(e)).abs();
        if diff > stats.max_abs {
            stats.max_abs = diff;
            stats.worst_index = i;
            stats.worst_got = a;
            stats.worst_expected = e;
        }
        diff_sq += diff * diff;
        exp_sq += f64::from(e) * f64::from(e);
    }
    stats.l2_rel = (exp_sq > 0.0).then(|| diff_sq.sqrt() / exp_sq.sqrt());
    let abs_ok = stats.max_abs <= f64::from(max_abs);
    let rel_ok = stats.l2_rel.is_none_or(|r| r <= f64::from(l2_rel));
    if abs_ok && rel_ok {
        Ok(stats)
    } else {
        Err(format!(
            "{name}: not close: {stats}; tolerances max-abs {max_abs:.3e}, L2-rel {l2_rel:.3e} ({} failed)",
            match (abs_ok, rel_ok) {
                (false, false) => "both",
                (false, true) => "max-abs",
                _ => "L2-rel",
            }
        ))
    }
}

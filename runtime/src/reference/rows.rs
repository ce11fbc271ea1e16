//! The f32 row arithmetic shared by the attention reference and the small-kernel models: one
//! head's row as a fixed-size array, and the dot product and `axpy` whose summation order the
//! reference's numerics depend on (see the numerics paragraph of the `reference` module doc).

use crate::contract::HEAD_DIM;

/// One head's row of 128 elements.
pub(super) type Row = [f32; HEAD_DIM];

// The unrolled loops below step by 8 and 4.
const _: () = assert!(HEAD_DIM / 8 * 8 == HEAD_DIM);

/// The `HEAD_DIM` elements of `data` at `at`, as a fixed-size row.
#[inline]
pub(super) fn row(data: &[f32], at: usize) -> &Row {
    data[at..at + HEAD_DIM]
        .try_into()
        .expect("a HEAD_DIM slice converts to a HEAD_DIM array")
}

/// [`row`], mutable.
#[inline]
pub(super) fn row_mut(data: &mut [f32], at: usize) -> &mut Row {
    (&mut data[at..at + HEAD_DIM])
        .try_into()
        .expect("a HEAD_DIM slice converts to a HEAD_DIM array")
}

// The two inner loops below use plain indices on fixed-size rows rather than iterator chains:
// they vectorise in release and run several times faster in unoptimised test builds.

/// f32 dot product of two rows with eight interleaved partial sums (fixed order).
#[inline]
pub(super) fn dot(a: &Row, b: &Row) -> f32 {
    let mut acc = [0.0f32; 8];
    let mut i = 0;
    while i < HEAD_DIM {
        acc[0] += a[i] * b[i];
        acc[1] += a[i + 1] * b[i + 1];
        acc[2] += a[i + 2] * b[i + 2];
        acc[3] += a[i + 3] * b[i + 3];
        acc[4] += a[i + 4] * b[i + 4];
        acc[5] += a[i + 5] * b[i + 5];
        acc[6] += a[i + 6] * b[i + 6];
        acc[7] += a[i + 7] * b[i + 7];
        i += 8;
    }
    ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]))
}

/// `y += a·x`.
#[inline]
pub(super) fn axpy(y: &mut Row, a: f32, x: &Row) {
    // Each element is one multiply-add, so both loop forms give bit-identical results. The
    // plain loop vectorises cleanly in release (the unrolled one does not); the unrolled one
    // is ~3× faster in unoptimised test builds.
    if cfg!(debug_assertions) {
        let mut i = 0;
        while i < HEAD_DIM {
            y[i] += a * x[i];
            y[i + 1] += a * x[i + 1];
            y[i + 2] += a * x[i + 2];
            y[i + 3] += a * x[i + 3];
            i += 4;
        }
    } else {
        for i in 0..HEAD_DIM {
            y[i] += a * x[i];
        }
    }
}

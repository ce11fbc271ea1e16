//! Aligned workspace scatter/gather and CPU models of the pre- and postprocess kernels.

use half::bf16;

use super::rows::{dot, row};
use super::{check_len, num_tokens, ReferenceError, KV_ROW, Q_ROW};
use crate::contract::{HEAD_DIM, NUM_Q_HEADS};

/// Scatters compact rows `[T, heads, 128]` into the aligned workspace layout `[W, heads, 128]`
/// (`docs/design.md` §1.5): token `t` of document `d` lands on row `ws_start[d] + (t − cu_seqlens[d])`;
/// padding rows are zero. Used for `k`/`v` (`heads = 4`) before a kernel launch.
///
/// # Errors
/// [`ReferenceError`] if `cu_seqlens` is malformed or `compact` is not `T·heads·128` long.
pub fn to_aligned(
    compact: &[f32],
    cu_seqlens: &[i32],
    heads: usize,
) -> Result<Vec<f32>, ReferenceError> {
    let (starts, rows) = crate::schedule::workspace_layout(cu_seqlens)?;
    let row = heads * HEAD_DIM;
    check_len(
        "compact",
        compact.len(),
        num_tokens(cu_seqlens)?,
        row,
        "[T,heads,128]",
    )?;
    let mut aligned = vec![0.0; rows * row];
    for (d, &ws) in starts.iter().enumerate() {
        // Documents are contiguous in both layouts: one copy each.
        let (lo, hi) = (cu_seqlens[d] as usize, cu_seqlens[d + 1] as usize);
        let at = ws as usize * row;
        aligned[at..at + (hi - lo) * row].copy_from_slice(&compact[lo * row..hi * row]);
    }
    Ok(aligned)
}

/// Gathers the token rows of an aligned `[W, heads, 128]` buffer back into compact
/// `[T, heads, 128]` (the inverse of [`to_aligned`]; padding rows are dropped).
///
/// # Errors
/// [`ReferenceError`] if `cu_seqlens` is malformed or `aligned` is not `W·heads·128` long.
pub fn from_aligned(
    aligned: &[f32],
    cu_seqlens: &[i32],
    heads: usize,
) -> Result<Vec<f32>, ReferenceError> {
    let (starts, rows) = crate::schedule::workspace_layout(cu_seqlens)?;
    let row = heads * HEAD_DIM;
    check_len("aligned", aligned.len(), rows, row, "[W,heads,128]")?;
    let tokens = num_tokens(cu_seqlens)?;
    let mut compact = Vec::with_capacity(tokens * row);
    for (d, &ws) in starts.iter().enumerate() {
        let len = (cu_seqlens[d + 1] - cu_seqlens[d]) as usize;
        let at = ws as usize * row;
        compact.extend_from_slice(&aligned[at..at + len * row]);
    }
    Ok(compact)
}

/// CPU model of the delta preprocess kernel (`docs/design.md` §3.2):
/// `delta[t,h] = Σ_d O[t,h,d]·dO[t,h,d]` in f32, shape `[T,64]`.
///
/// # Errors
/// [`ReferenceError::Length`] unless `out` and `dout` are both `[num_tokens,64,128]`.
pub fn preprocess_delta(
    out: &[f32],
    dout: &[f32],
    num_tokens: usize,
) -> Result<Vec<f32>, ReferenceError> {
    check_len("out", out.len(), num_tokens, Q_ROW, "[T,64,128]")?;
    check_len("dout", dout.len(), num_tokens, Q_ROW, "[T,64,128]")?;
    let rows = num_tokens * NUM_Q_HEADS;
    Ok((0..rows)
        .map(|r| {
            let at = r * HEAD_DIM;
            dot(row(out, at), row(dout, at))
        })
        .collect())
}

/// Element of the head-pair-interleaved dQ pool `[T,32,128,2]` that holds `dQ[t,h,d]`
/// (`docs/design.md` §3.6: pool element `(t, hp, d, e)` is `dQ[t, 2hp+e, d]`).
fn pool_index(t: usize, h: usize, d: usize) -> usize {
    (((t * NUM_Q_HEADS / 2 + h / 2) * HEAD_DIM + d) * 2) + h % 2
}

fn check_dq_len(field: &'static str, len: usize) -> Result<usize, ReferenceError> {
    // Not `is_multiple_of`: that needs Rust 1.87, the workspace targets 1.85.
    if len / Q_ROW * Q_ROW == len {
        Ok(len / Q_ROW)
    } else {
        Err(ReferenceError::Length {
            field,
            found: len,
            expected: format!("a multiple of {Q_ROW} ([T,64,128] or [T,32,128,2])"),
        })
    }
}

/// Builds the head-pair-interleaved dQ pool `[T,32,128,2]` from a plain `[T,64,128]` dQ
/// (works for `f32` and [`bf16`] alike); used to make inputs for the postprocess kernel.
///
/// # Errors
/// [`ReferenceError::Length`] unless the length is a multiple of `64·128`.
pub fn interleave_dq_pool<E: Copy>(dq: &[E]) -> Result<Vec<E>, ReferenceError> {
    let tokens = check_dq_len("dq", dq.len())?;
    let mut pool = dq.to_vec();
    for t in 0..tokens {
        for h in 0..NUM_Q_HEADS {
            for d in 0..HEAD_DIM {
                pool[pool_index(t, h, d)] = dq[(t * NUM_Q_HEADS + h) * HEAD_DIM + d];
            }
        }
    }
    Ok(pool)
}

/// Inverse of [`interleave_dq_pool`]: `[T,32,128,2]` pool to plain `[T,64,128]`.
///
/// # Errors
/// [`ReferenceError::Length`] unless the length is a multiple of `64·128`.
pub fn deinterleave_dq_pool<E: Copy>(pool: &[E]) -> Result<Vec<E>, ReferenceError> {
    let tokens = check_dq_len("dq_pool", pool.len())?;
    let mut dq = pool.to_vec();
    for t in 0..tokens {
        for h in 0..NUM_Q_HEADS {
            for d in 0..HEAD_DIM {
                dq[(t * NUM_Q_HEADS + h) * HEAD_DIM + d] = pool[pool_index(t, h, d)];
            }
        }
    }
    Ok(dq)
}

/// Exact CPU model of the postprocess (`grad_finalize`) kernel (`docs/design.md` §3.6).
///
/// De-interleaves the bf16 dQ pool `[T,32,128,2]` into `dq [T,64,128]` (a pure permutation)
/// and casts the fp32 dK and dV pools (`[W,4,128]`) to bf16 with round-to-nearest-even.
/// Returns `(dq, dk, dv)`.
///
/// # Errors
/// [`ReferenceError::Length`] unless `dq_pool` is a multiple of `64·128` elements and each
/// kv pool a multiple of `4·128`.
#[allow(clippy::type_complexity)] // the three kernel outputs, in kernel order
pub fn postprocess(
    dq_pool: &[bf16],
    dk_pool: &[f32],
    dv_pool: &[f32],
) -> Result<(Vec<bf16>, Vec<bf16>, Vec<bf16>), ReferenceError> {
    let dq = deinterleave_dq_pool(dq_pool)?;
    for (field, pool) in [("dk_pool", dk_pool), ("dv_pool", dv_pool)] {
        if pool.len() / KV_ROW * KV_ROW != pool.len() {
            return Err(ReferenceError::Length {
                field,
                found: pool.len(),
                expected: format!("a multiple of {KV_ROW} ([W,4,128])"),
            });
        }
    }
    let cast = |pool: &[f32]| pool.iter().map(|&x| bf16::from_f32(x)).collect();
    Ok((dq, cast(dk_pool), cast(dv_pool)))
}

/// Keys each (index head, query) attends, `[4, T]`: the causal keys inside its selected
/// document-local blocks (`q2k [4, T, 16]`, −1 padding). Summed over the 16 query heads of a
/// group this is the `sparse_elements` count of the MSA FLOP convention.
///
/// # Errors
/// [`ReferenceError`] if `cu_seqlens` is malformed or `q2k` is not `4·T·16` long.
pub fn keys_attended(q2k: &[i32], cu_seqlens: &[i32]) -> Result<Vec<usize>, ReferenceError> {
    use crate::contract::{BLOCK_SIZE, NUM_INDEX_HEADS, TOPK_BLOCKS};
    let t_total = num_tokens(cu_seqlens)?;
    check_len(
        "q2k",
        q2k.len(),
        NUM_INDEX_HEADS * t_total,
        TOPK_BLOCKS,
        "[4,T,16]",
    )?;
    let mut kept = vec![0usize; NUM_INDEX_HEADS * t_total];
    for g in 0..NUM_INDEX_HEADS {
        for w in cu_seqlens.windows(2) {
            let (start, end) = (w[0] as usize, w[1] as usize);
            for t in start..end {
                let local = t - start;
                let ids = &q2k[(g * t_total + t) * TOPK_BLOCKS..][..TOPK_BLOCKS];
                kept[g * t_total + t] = ids
                    .iter()
                    .filter(|&&b| b >= 0 && b as usize * BLOCK_SIZE <= local)
                    .map(|&b| (local + 1 - b as usize * BLOCK_SIZE).min(BLOCK_SIZE))
                    .sum();
            }
        }
    }
    Ok(kept)
}
